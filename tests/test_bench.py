"""The benchmark-only synthetic backend and `replicadp sweep`, with real replica processes."""

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import run_client_on, start_replicas
from replicadp_tasks.pipeline import REFERENCE_WORK

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
