"""The benchmark-only synthetic backend and `replicadp sweep`, with real replica processes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_client_on, start_replicas
from replicadp_tasks.contract import REFERENCE_WORK

REPLICADP = str(Path(sys.executable).parent / "replicadp")


def test_synthetic_backend_is_scaled_deterministic_and_named(redis_db, tmp_path):
    """synthetic:SECONDS spends SECONDS x work / reference work per request, says it is the benchmark backend,
    and its frames depend on the inputs alone: same input, same hashes on either replica; another seed differs."""
    url = redis_db()
    group = start_replicas(2, url, "synthetic", model="synthetic:40", OUTPUT_DIR=str(tmp_path))
    size = {"height": 128, "width": 128, "num_frames": 33, "num_inference_steps": 30}
    requests = [{"prompt": "p", "seed": 1, **size} for _ in range(4)] + [{"prompt": "p", "seed": 2, **size}]
    try:
        outcomes = run_client_on(url, requests, concurrency=5)
    finally:
        group.stop()
    assert all(o.ok for o in outcomes), [o.error for o in outcomes]
    expected = 40 * 128 * 128 * 33 * 30 / REFERENCE_WORK
    for o in outcomes:
        assert o.result["model"] == "synthetic:40" and "synthetic benchmark backend" in o.result["device"]
        assert expected <= o.result["timings"]["inference_s"] < expected + 0.5
    same = outcomes[:4]
    assert {o.result["replica"] for o in same} == set(group.names)
    assert len({o.result["frames_sha256"] for o in same}) == 1 and len({o.result["video_sha256"] for o in same}) == 1
    assert outcomes[4].result["frames_sha256"] != same[0].result["frames_sha256"]


def test_sweep_prints_and_writes_table_json_markdown_png(tmp_path, tiny_model):
    """`replicadp sweep` runs the bench at each N on its own embedded server, rounds the request count to a
    multiple of every N (and says so), and writes the report as JSON, Markdown and a PNG plot."""
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env["TMPDIR"] = str(tmp_path)
    out = tmp_path / "res" / "sweep"
    run = subprocess.run([REPLICADP, "sweep", "--replicas", "1,2", "--model", "synthetic:20", "--size", "128x128",
                          "--num-frames", "17", "--steps", "30", "--num-requests", "3", "--out", str(out)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "--num-requests 3 -> 4" in run.stdout and "efficiency" in run.stdout
    reports = json.loads(out.with_suffix(".json").read_text())
    assert [r["replicas"] for r in reports] == [1, 2] and all(r["completed"] == 4 for r in reports)
    assert reports[0]["efficiency"] == 1.0 and 0.5 < reports[1]["efficiency"] < 1.2
    assert "| 2 |" in out.with_suffix(".md").read_text()
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["res"]  # the sweep's run folder is gone


def test_serving_cost_compares_a_baseline_commit_in_one_run(tmp_path):
    """bench/serving_cost.py runs this tree and a baseline commit (a git worktree, removed after) in alternate
    rounds at 1 step and more, with a set compute per request, and writes per tree the time (in all, and beyond the
    compute), CPU, Redis commands (in all and by name) and round trips per request and per step, and where a
    request's time goes by phase."""
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env["TMPDIR"] = str(tmp_path)
    out = tmp_path / "res" / "cost.json"
    root = Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, str(root / "bench" / "serving_cost.py"), "--requests", "4", "--rounds", "1",
                          "--steps", "3", "--compute-ms", "20", "--baseline", "HEAD", "--out", str(out)],
                         env=env, capture_output=True, text=True, timeout=300, cwd=root)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    results = report["results"]
    assert report["model"] == "synthetic:0:0.02"
    assert len(results) == 2 and "this tree" in results and "where one request's time goes" in run.stdout
    for got in results.values():
        assert got["rounds"]["1"][0]["failed"] == got["rounds"]["3"][0]["failed"] == 0
        assert got["ms_per_request_1_step"] > 20 and got["cpu_ms_per_request_1_step"]["replica child"] > 0
        assert got["serving_ms_per_request_1_step"] == pytest.approx(got["ms_per_request_1_step"] - 20)
        assert got["rounds"]["1"][0]["redis_commands_by_name"]["brpop"] >= 0.5  # a request is popped once
        assert {"inputs and fence", "encoding", "storing and result"} <= set(got["phases_ms_3_steps"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["res"]  # its run folder and worktree are gone
    worktrees = subprocess.run(["git", "-C", str(root), "worktree", "list"], capture_output=True, text=True).stdout
    assert str(tmp_path) not in worktrees


def test_vllm_omnis_baseline_is_written_and_checked(redis_db, tmp_path):
    """vllm-omni's isolation baseline (bench_replica_dp.py's manifest: prompt, seed, WIDTHxHEIGHT, frames and
    steps joined by the unit separator -> MD5 of the MP4 that POST /v1/videos/sync answered), made the way that
    script makes it, against replicadp's gateway one request at a time: `bench --write-baseline --baseline-format
    vllm-omni` writes the same manifest, `bench --check-baseline` reads it and passes at concurrency 2, and by
    that script's rules an altered hash is a mismatch, an output the baseline lacks unknown and a baseline input
    the run did not make unverified, each failing the check (exit 1)."""
    import hashlib

    from test_http import gateway

    url = redis_db()
    prompts = ["a lighthouse in a storm", "a kite over a beach"]
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("\n".join([prompts[0], "", prompts[1]]) + "\n")  # blank lines are skipped by both
    size, frames, steps, count = "64x64", "5", "2", 4
    theirs = {}

    def bench(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([REPLICADP, "bench", "--num-requests", str(count), "--prompts-file", str(prompts_file),
                               "--size", size, "--num-frames", frames, "--steps", steps, *args],
                              env={**os.environ, "REDIS_URL": url}, capture_output=True, text=True, timeout=300)

    group = start_replicas(2, url, "vllm-omni-baseline", model="synthetic:20")
    try:
        with gateway(url, "vllm-omni-baseline") as gw:  # bench_replica_dp.py's step 1: its requests, its manifest
            for i in range(count):
                prompt, seed = prompts[i % len(prompts)], str(42 + i)
                form = {"prompt": prompt, "size": size, "num_frames": frames, "num_inference_steps": steps,
                        "seed": seed}
                r = gw.client.post("/v1/videos/sync", files={k: (None, v) for k, v in form.items()})
                assert r.status_code == 200, r.text
                theirs["\x1f".join([prompt, seed, size, frames, steps])] = hashlib.md5(r.content).hexdigest()
        (tmp_path / "theirs.json").write_text(json.dumps(theirs, indent=2))
        written = bench("--concurrency", "1", "--write-baseline", str(tmp_path / "ours.json"),
                        "--baseline-format", "vllm-omni")
        checked = bench("--concurrency", "2", "--check-baseline", str(tmp_path / "theirs.json"),
                        "--json", str(tmp_path / "checked.json"))
        altered = dict(theirs)
        keys = list(altered)
        altered[keys[0]] = "0" * 32  # another video
        del altered[keys[1]]  # an input it never saw
        altered["\x1f".join([prompts[0], "99", size, frames, steps])] = "f" * 32  # an input this run does not make
        (tmp_path / "altered.json").write_text(json.dumps(altered, indent=2))
        failed = bench("--concurrency", "2", "--check-baseline", str(tmp_path / "altered.json"),
                       "--json", str(tmp_path / "failed.json"))
    finally:
        group.stop()
    assert written.returncode == 0, written.stdout + written.stderr
    assert json.loads((tmp_path / "ours.json").read_text()) == theirs
    assert checked.returncode == 0, checked.stdout + checked.stderr
    iso = json.loads((tmp_path / "checked.json").read_text())["isolation"]
    assert (iso["format"], iso["matched"], iso["passed"]) == ("vllm-omni", count, True), iso
    assert failed.returncode == 1, failed.stdout + failed.stderr
    iso = json.loads((tmp_path / "failed.json").read_text())["isolation"]
    assert {k: iso[k] for k in ("matched", "mismatched", "unknown", "unverified", "passed")} == {
        "matched": 2, "mismatched": 1, "unknown": 1, "unverified": 1, "passed": False}, iso
    assert iso["not_verified"] == [{"prompt": prompts[0], "seed": 99}]
    assert "mp4_md5 differ" in failed.stdout and "not verified seed=99" in failed.stdout


def test_baseline_format_mistakes_are_usage_errors(tmp_path):
    """Before anything is sent (exit 2, no Redis needed): --baseline-format without --write-baseline, a file that
    is neither kind of baseline, and a vllm-omni baseline with what it cannot hold (a quality, the videos that
    --tolerance-psnr compares)."""
    theirs, other = tmp_path / "theirs.json", tmp_path / "other.json"
    theirs.write_text(json.dumps({"\x1f".join(["a fox", "42", "64x64", "5", "2"]): "0" * 32}, indent=2))
    other.write_text(json.dumps(["not", "a", "baseline"]))
    cases = [(["--baseline-format", "vllm-omni"], "only with --write-baseline"),
             (["--check-baseline", str(other)], "neither replicadp's baseline"),
             (["--check-baseline", str(theirs), "--quality", "mixed"], "vllm-omni's baseline keys carry no quality"),
             (["--write-baseline", str(tmp_path / "w.json"), "--baseline-format", "vllm-omni", "--quality", "fast"],
              "carry no quality"),
             (["--check-baseline", str(theirs), "--tolerance-psnr", "30"], "keeps no videos")]
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    for args, message in cases:
        run = subprocess.run([REPLICADP, "bench", *args], env=env, capture_output=True, text=True, timeout=60)
        assert run.returncode == 2 and message in " ".join(run.stderr.split()), (args, run.stderr)
