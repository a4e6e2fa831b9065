"""The producer side through the `replicadp` command, as a user runs it, against real replicas."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from client.api import run_requests
from conftest import SESSION_DIR, start_replicas

REPLICADP = str(Path(sys.executable).parent / "replicadp")
SMALL = ["--size", "64x64", "--num-frames", "9", "--steps", "4"]


def cli(*args, redis_url, timeout=300):
    env = {**os.environ, "REDIS_URL": redis_url}
    return subprocess.run([REPLICADP, *args], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def baseline(redis_db, tiny_model, tmp_path_factory):
    """A baseline recorded by one replica (its own DB), one request at a time: the reference protocol's step 1."""
    url = redis_db()
    group = start_replicas(1, url, "single", OUTPUT_DIR=str(SESSION_DIR / "outputs-single"))
    path = tmp_path_factory.mktemp("bench") / "baseline.json"
    report = path.with_name("one.json")
    try:
        run = cli("bench", "--num-requests", "6", "--concurrency", "1", "--warmup", "0", *SMALL,
                  "--write-baseline", str(path), "--json", str(report), redis_url=url)
    finally:
        group.stop()
    assert run.returncode == 0, run.stdout + run.stderr
    return path, json.loads(report.read_text())


def test_one_replica_writes_the_baseline(baseline):
    """With one replica serially, every input's hashes are recorded, and the JSON report holds the figures."""
    path, report = baseline
    entries = json.loads(path.read_text())["entries"]
    assert len(entries) == 6 and {e["seed"] for e in entries.values()} == set(range(42, 48))
    assert report["replicas"] == 1 and report["completed"] == 6 and report["failed"] == 0
    assert report["videos_per_min"] > 0 and report["makespan_s"] > 0
    assert 0 < report["latency_s"]["p50"] <= report["latency_s"]["p90"] <= report["latency_s"]["max"]
    assert report["queue_wait_s"]["p50"] is not None and report["inference_s"]["p50"] > 0
    assert list(report["per_replica"]) == [next(iter(entries.values()))["replica"]]


def test_two_replicas_under_concurrency_match_the_baseline(baseline, replicas, redis_server, tmp_path):
    """Two replicas at concurrency 4 reproduce every baseline output bit for bit; the check passes (exit 0)
    and the report shows scaling against the one-replica throughput."""
    path, one = baseline
    report = tmp_path / "two.json"
    run = cli("bench", "--num-requests", "6", "--concurrency", "4", *SMALL, "--check-baseline", str(path),
              "--baseline-tpm", str(one["videos_per_min"]), "--json", str(report), redis_url=redis_server.url)
    assert run.returncode == 0, run.stdout + run.stderr
    rep = json.loads(report.read_text())
    iso = rep["isolation"]
    assert (iso["matched"], iso["mismatched"], iso["unknown"], iso["unverified"]) == (6, 0, 0, 0)
    assert rep["replicas"] == 2 and set(rep["per_replica"]) == set(replicas.names)
    assert rep["scaling"] == pytest.approx(rep["videos_per_min"] / one["videos_per_min"])
    assert rep["efficiency"] == pytest.approx(rep["scaling"] / 2)
    assert "PASS" in run.stdout


def test_tampered_baseline_fails_the_check(baseline, replicas, redis_server, tmp_path):
    """A baseline whose hash for one input was altered makes the check exit 1 and print that input."""
    path, _ = baseline
    data = json.loads(path.read_text())
    key = sorted(data["entries"])[0]
    data["entries"][key]["frames_sha256"] = "0" * 64
    tampered = tmp_path / "tampered.json"
    tampered.write_text(json.dumps(data))
    run = cli("bench", "--num-requests", "6", "--concurrency", "4", *SMALL, "--check-baseline", str(tampered),
              redis_url=redis_server.url)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "mismatch" in run.stdout and f"seed={data['entries'][key]['seed']}" in run.stdout
    assert "no baseline video to compare" in run.stdout  # its videos stayed beside the original


def test_other_inputs_are_unknown_to_the_baseline(baseline, replicas, redis_server):
    """Inputs the baseline never recorded (another base seed) count as unknown and fail the check."""
    path, _ = baseline
    run = cli("bench", "--num-requests", "2", "--concurrency", "2", "--base-seed", "7", *SMALL,
              "--check-baseline", str(path), redis_url=redis_server.url)
    assert run.returncode == 1 and "2 unknown" in run.stdout, run.stdout


def test_usage_errors_exit_2(redis_server, tmp_path):
    """Both baseline flags, or a malformed --size, are usage errors: exit 2 before anything is sent."""
    f = tmp_path / "b.json"
    f.write_text("{}")
    both = cli("bench", "--write-baseline", str(tmp_path / "w.json"), "--check-baseline", str(f),
               redis_url=redis_server.url)
    assert both.returncode == 2 and "exclusive" in both.stderr
    size = cli("bench", "--size", "832by480", redis_url=redis_server.url)
    assert size.returncode == 2 and "WIDTHxHEIGHT" in size.stderr


def test_unreachable_redis_is_a_clear_error_within_seconds():
    """With nothing listening at REDIS_URL, bench fails fast with the URL (password hidden), not a hang."""
    started = time.monotonic()
    run = cli("bench", "--num-requests", "1", redis_url="redis://:secret@127.0.0.1:1/0", timeout=60)
    assert run.returncode == 1
    assert "cannot reach Redis at redis://:***@127.0.0.1:1/0" in run.stderr and "secret" not in run.stderr
    assert time.monotonic() - started < 20


def test_failed_requests_are_reported_while_the_others_complete(replicas):
    """Through the Python API, an invalid request in a batch comes back failed with its message and the
    valid ones complete."""
    requests = [{"prompt": "a fox", "seed": 1, "height": 64, "width": 64, "num_frames": 9, "num_inference_steps": 2},
                {"prompt": "a fox", "seed": 2, "height": 64, "width": 48, "num_frames": 9, "num_inference_steps": 2},
                {"prompt": "a fox", "seed": 3, "height": 64, "width": 64, "num_frames": 9, "num_inference_steps": 2}]
    outcomes = sorted(run_requests(requests, concurrency=2, timeout=60), key=lambda o: o.index)
    assert [o.ok for o in outcomes] == [True, False, True]
    assert outcomes[1].error == "InvalidRequest: width=48: must be a multiple of 32 for this model"


def test_submit_batch_is_resumable(replicas, redis_server, tmp_path):
    """`submit` runs a JSONL file, appends results, fetches the MP4s, and a second run skips what completed."""
    batch = tmp_path / "batch.jsonl"
    batch.write_text("\n".join(json.dumps({"prompt": p, "seed": s, "height": 64, "width": 64, "num_frames": 9,
                                           "num_inference_steps": 2}) for p, s in [("a fox", 1), ("a whale", 2)])
                     + '\n{"prompt": "named", "request_id": "my-id", "height": 64, "width": 64, "num_frames": 5}\n')
    videos = tmp_path / "videos"
    first = cli("submit", str(batch), "--save-dir", str(videos), redis_url=redis_server.url)
    assert first.returncode == 0, first.stdout + first.stderr
    results = [json.loads(line) for line in (tmp_path / "batch.jsonl.results.jsonl").read_text().splitlines()]
    assert sorted(r["line"] for r in results) == [1, 2, 3] and all(r["ok"] for r in results)
    assert (videos / "my-id.mp4").stat().st_size > 0 and len(list(videos.iterdir())) == 3
    again = cli("submit", str(batch), redis_url=redis_server.url)
    assert again.returncode == 0 and "3 already completed; submitting 0" in again.stdout


def test_submit_refuses_a_malformed_file_before_sending(redis_server, tmp_path):
    """A malformed line is reported with its number and nothing is submitted (no results file)."""
    batch = tmp_path / "bad.jsonl"
    batch.write_text('{"prompt": "fine"}\n{"prompt": "x", "num_frames": 8}\n')
    run = cli("submit", str(batch), redis_url=redis_server.url)
    assert run.returncode == 1 and "line 2: num_frames=8" in run.stderr
    assert not (tmp_path / "bad.jsonl.results.jsonl").exists()


def test_status_lists_the_live_replicas(replicas, redis_server):
    """`status` shows each replica with its device and model, and the queue depth."""
    run = cli("status", redis_url=redis_server.url)
    assert run.returncode == 0, run.stderr
    for name in replicas.names:
        assert name in run.stdout
    assert "tiny" in run.stdout and "waiting" in run.stdout
