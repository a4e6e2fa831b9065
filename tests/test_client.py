"""The producer side through the `replicadp` command, as a user runs it, against real replicas."""

import codecs
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from client.api import run_requests
from client.results import ResultWatch
from client.submit import BatchFileError, read_batch
from conftest import SESSION_DIR, start_replicas
from helpers import wait_for
from replicadp_tasks import app

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
    assert run.returncode == 3  # cli.Exit.UNAVAILABLE
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


def test_closing_the_result_watch_does_not_wait_out_its_read(redis_server):
    """A caller that has its results goes on at once: closing the result waiter does not wait for the pub/sub read
    its thread has in progress (up to SWEEP_S; `run_requests` returned that much after its last result); the
    thread ends by itself once that read returns."""
    watch = ResultWatch(app.backend, lambda task_id, meta: None).start()
    wait_for(lambda: app.backend.client.pubsub_numpat() >= 1, "the result waiter to subscribe", interval=0.01)
    watch.close()
    assert watch._thread.is_alive()  # still in its read: close did not join it
    wait_for(lambda: not watch._thread.is_alive(), "the result waiter's thread to end", timeout=10)


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


# --- batch files that could be read more than one way: refused, naming the line, rather than guessed at ------

def batch_file(tmp_path, data: bytes, name: str = "batch.jsonl") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def test_a_jsonl_batch_with_a_byte_order_mark_is_jsonl(tmp_path):
    """A UTF-8 byte order mark (Windows editors write one) does not turn a JSONL batch into a text batch whose
    prompt is the JSON line: its requests are read as written, also after blank lines, and a mark that starts
    a later line (a file appended to another) is dropped too."""
    line = json.dumps({"prompt": "a fox", "height": 64, "width": 64}) + "\n"
    for data in (codecs.BOM_UTF8 + line.encode(), ("\n  \n\t\n" + line).encode(),
                 (line + "\ufeff" + line.replace("fox", "whale")).encode()):
        batch = read_batch(batch_file(tmp_path, data))
        assert [kw["prompt"] for _, kw in batch][:1] == ["a fox"] and batch[0][1]["height"] == 64, batch
    assert [n for n, _ in read_batch(batch_file(tmp_path, ("\n  \n\t\n" + line).encode()))] == [4]


def test_a_batch_that_is_not_utf8_is_refused_naming_the_byte_and_line(tmp_path):
    """Latin-1 (after a byte order mark or not) or UTF-16 bytes are refused naming the file, the byte, its
    offset in the file and its line, instead of a traceback or a guess."""
    latin1 = '{"prompt": "a"}\n{"prompt": "café"}\n'.encode("latin-1")
    for data in (latin1, codecs.BOM_UTF8 + latin1):
        path = batch_file(tmp_path, data)
        with pytest.raises(BatchFileError) as err:
            read_batch(path)
        offset = data.index("é".encode("latin-1"))
        assert str(err.value) == f"{path}: not UTF-8: byte 0xe9 at byte offset {offset} (line 2); save the batch " \
                                 "file as UTF-8"
    with pytest.raises(BatchFileError, match="UTF-16 byte order mark"):
        read_batch(batch_file(tmp_path, '{"prompt": "a"}\n'.encode("utf-16")))


def test_a_text_batch_with_lines_that_look_like_json_is_refused(tmp_path):
    """In a text batch (its first line does not start with '{'), a line that starts with '{', valid JSON or
    not, or that is a JSON array, is refused by line number: the file was meant as JSONL, or is broken. A
    prompt that merely starts with '[' is a prompt; an empty file is refused."""
    path = batch_file(tmp_path, b'a fox\n{"prompt": "x"}\n{not json\n[{"prompt": "y"}]\n[cinematic] a whale\n',
                      "prompts.txt")
    with pytest.raises(BatchFileError) as err:
        read_batch(path)
    bad = [line.split(":")[0] for line in str(err.value).splitlines()[1:]]
    assert bad == ["line 2", "line 3", "line 4"] and "looks like JSON in a text batch" in str(err.value)
    assert read_batch(batch_file(tmp_path, b"a fox\n[cinematic] a whale\n", "ok.txt"))[1][1]["prompt"] == \
        "[cinematic] a whale"
    with pytest.raises(BatchFileError, match="no requests"):
        read_batch(batch_file(tmp_path, b" \n\n", "blank.txt"))


def test_a_jsonl_key_given_twice_is_refused(tmp_path):
    """A JSONL line with a key twice (json.loads would silently keep the last) is refused, naming line and key."""
    with pytest.raises(BatchFileError) as err:
        read_batch(batch_file(tmp_path, b'{"prompt": "a"}\n{"prompt": "b", "seed": 1, "seed": 2}\n'))
    assert str(err.value).endswith("line 2: key 'seed' given twice; give each argument once")


def test_a_line_separator_inside_a_json_string_does_not_split_the_line(tmp_path):
    """Lines end at \\n, \\r\\n or \\r only: U+2028 inside a JSON string (json.dumps(ensure_ascii=False)
    writes it as is) keeps its line whole and numbered as an editor numbers it."""
    lines = [json.dumps({"prompt": "one\u2028two"}, ensure_ascii=False), json.dumps({"prompt": "three"})]
    batch = read_batch(batch_file(tmp_path, "\r\n".join(lines).encode()))
    assert [(n, kw["prompt"]) for n, kw in batch] == [(1, "one\u2028two"), (2, "three")]


def test_submit_refuses_a_batch_that_is_not_utf8_without_a_traceback(tmp_path):
    """`replicadp submit` on a Latin-1 file exits 1 with the error naming the file and line, no traceback, and
    before it needs Redis."""
    path = batch_file(tmp_path, "a fox\ncafé\n".encode("latin-1"), "prompts.txt")
    run = cli("submit", str(path), redis_url="redis://127.0.0.1:1/0", timeout=60)
    assert run.returncode == 1 and f"{path}: not UTF-8: byte 0xe9" in run.stderr and "(line 2)" in run.stderr
    assert "Traceback" not in run.stderr
