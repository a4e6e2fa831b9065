"""The embedded default as a newcomer meets it: `replicadp demo`, `up` / `down`, the server's security."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis

REPLICADP = str(Path(sys.executable).parent / "replicadp")


def started_with(tmp: Path) -> set[int]:
    """PIDs of the processes running with TMPDIR=`tmp`: what a test started with clean_env (its servers and
    replicas among them), and nothing another test or another run on this machine started."""
    mark = f"TMPDIR={tmp}".encode()
    pids = set()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if mark in proc.joinpath("environ").read_bytes().split(b"\0"):
                pids.add(int(proc.name))
        except OSError:  # gone, or not ours
            pass
    return pids


@pytest.fixture
def clean_env(tmp_path):
    """An environment with no REDIS_URL, its own state folder and its own TMPDIR (checked empty after)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env.update(TMPDIR=str(tmp), REPLICADP_STATE_DIR=str(tmp_path / "state"))
    return env, tmp


def test_demo_runs_the_reference_protocol_and_cleans_up(clean_env, tmp_path, tiny_model):
    """`replicadp demo` starts its own server, benches 1 then 2 replicas, passes the isolation check,
    prints the table and where the videos are, and leaves no process or temp folder behind."""
    env, tmp = clean_env
    out = tmp_path / "videos"
    run = subprocess.run([REPLICADP, "demo", "--num-requests", "4", "--size", "64x64", "--num-frames", "9",
                          "--steps", "4", "--output-dir", str(out)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "isolation PASS: 4 matched, 0 mismatched, 0 unknown, 0 unverified" in run.stdout
    assert "videos/min" in run.stdout and "efficiency" in run.stdout
    assert str(out) in run.stdout.replace("\n", "")
    assert len(list(out.glob("*.mp4"))) >= 8  # both phases' videos (and the warm-ups)
    assert started_with(tmp) == set()
    assert list(tmp.iterdir()) == []


def test_up_then_plain_generate_then_down(clean_env, tiny_model):
    """After `replicadp up`, `generate.delay().get()` works with no variable set (the URL comes from up's
    state); `down` stops the server and the replicas."""
    env, tmp = clean_env
    up = subprocess.run([REPLICADP, "up", "--replicas", "1"], env=env, capture_output=True, text=True, timeout=300)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        state = json.loads((Path(env["REPLICADP_STATE_DIR"]) / "state.json").read_text())
        assert len(started_with(tmp)) >= 2  # the server and the replica (with its launcher and pool child)
        code = ("from replicadp_tasks import generate; import json; print(json.dumps(generate.delay(prompt='x', "
                "height=64, width=64, num_frames=9, num_inference_steps=4).get(timeout=60)))")
        gen = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert gen.returncode == 0, gen.stderr
        meta = json.loads(gen.stdout)
        assert meta["replica"] == state["replicas"][0] and len(meta["frames_sha256"]) == 64
    finally:
        down = subprocess.run([REPLICADP, "down"], env=env, capture_output=True, text=True, timeout=120)
    assert down.returncode == 0 and "stopped 1 replica" in down.stdout
    assert started_with(tmp) == set()
    assert not (Path(env["REPLICADP_STATE_DIR"]) / "state.json").exists()


def test_embedded_server_wants_the_password_and_listens_on_loopback(redis_server):
    """A connection without the password is refused; the server binds 127.0.0.1 and keeps an append-only file."""
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(host="127.0.0.1", port=redis_server.port).ping()
    client = redis.Redis.from_url(redis_server.url)
    assert client.config_get("bind")["bind"] == "127.0.0.1"
    assert client.config_get("appendonly")["appendonly"] == "yes"
    assert client.config_get("appendfsync")["appendfsync"] == "always"
