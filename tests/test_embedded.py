"""The embedded default as a newcomer meets it: `replicadp demo`, `up` / `down` (and the supervisor that
restarts up's server), the server's security."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis

from helpers import SYNTHETIC, lasting, wait_for
from replicadp_tasks.cluster import connection

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


def test_demo_runs_the_reference_protocol_and_cleans_up(clean_env, tmp_path, tiny_model):
    """`replicadp demo` starts its own server, benches 1 then 2 replicas, passes the isolation check,
    prints the table and where the videos are, and leaves no process or temp folder behind. Run as a user runs it
    (no TORCHINDUCTOR_CACHE_DIR: this test process's own, which torch put in the environment, is dropped): importing
    diffusers creates torch's inductor cache folder (`$TMPDIR/torchinductor_<user>`, empty) in every process that
    does, and the demo leaves none in the temp folder it was given."""
    env, tmp = clean_env
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
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
    assert list(tmp.glob("torchinductor_*")) == []
    assert list(tmp.iterdir()) == []


def test_up_then_plain_generate_then_down(clean_env, tiny_model):
    """After `replicadp up`, `generate.delay().get()` works with no variable set (the URL comes from up's
    state); `down` stops the server and the replicas."""
    env, tmp = clean_env
    up = subprocess.run([REPLICADP, "up", "--replicas", "1", "--devices", "cpu"], env=env, capture_output=True,
                        text=True, timeout=300)
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


def children(pid: int) -> list[int]:
    """The live (not zombie) child processes of `pid`."""
    kids = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return [k for k in kids if alive(k)]


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def served_by(env: dict) -> str:
    """The replica that serves a short request sent, as a user would, from a process on `env` (`up`'s state)."""
    code = ("import json, sys; from replicadp_tasks import generate; "
            "print(json.dumps(generate.delay(**json.loads(sys.argv[1])).get(timeout=90)))")
    gen = subprocess.run([sys.executable, "-c", code, json.dumps(lasting(0.25))], env=env, capture_output=True,
                         text=True, timeout=150)
    assert gen.returncode == 0, gen.stderr
    return json.loads(gen.stdout)["replica"]


def test_up_restarts_its_killed_server_with_its_data(clean_env):
    """`replicadp up` runs its server under a supervisor: SIGKILL the Valkey process itself, and the server
    answers again on the same URL within seconds (a new process, the supervisor's child), with a key written
    before the kill still there (append-only file), the restart logged with its exit status, and a request sent
    afterwards served by the replica. The password is on no command line. `down` leaves neither the supervisor
    nor the server behind."""
    env, tmp = clean_env
    up = subprocess.run([REPLICADP, "up", "--replicas", "1", "--devices", "cpu", "--threads", "1", "--model",
                         SYNTHETIC], env=env, capture_output=True, text=True, timeout=300)
    supervisor = servers = None
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        state = json.loads((Path(env["REPLICADP_STATE_DIR"]) / "state.json").read_text())
        supervisor = state["servers"][0]["pid"]
        servers = children(supervisor)
        assert len(servers) == 1
        password = urlsplit(state["redis_url"]).password
        for pid in (supervisor, *servers):
            assert password.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
        client = redis.Redis.from_url(state["redis_url"], socket_connect_timeout=1, socket_timeout=5)
        client.set("written-before-the-kill", "kept")

        killed_at = time.monotonic()
        os.kill(servers[0], signal.SIGKILL)
        wait_for(lambda: not alive(servers[0]), "the killed server to exit", timeout=10, interval=0.01)

        def answers() -> bool:
            try:
                return client.ping()
            except redis.exceptions.ConnectionError:
                return False

        wait_for(answers, "the server to answer again on the same URL", timeout=15, interval=0.02)
        restart_s = time.monotonic() - killed_at
        print(f"server answered again {restart_s:.2f} s after its SIGKILL")
        assert restart_s < 10
        servers += [pid for pid in children(supervisor) if pid not in servers]
        assert len(servers) == 2
        assert client.get("written-before-the-kill") == b"kept"
        log = (Path(state["run_dir"]) / "redis" / "supervisor.log").read_text()
        assert f"valkey (pid {servers[0]}) exited with status -9 (SIGKILL)" in log, log

        assert served_by(env) == state["replicas"][0]
    finally:
        down = subprocess.run([REPLICADP, "down"], env=env, capture_output=True, text=True, timeout=120)
    assert down.returncode == 0 and "stopped 1 replica" in down.stdout, down.stdout + down.stderr
    assert not any(Path(f"/proc/{pid}").exists() for pid in (supervisor, *servers))
    assert started_with(tmp) == set()
    assert not (Path(env["REPLICADP_STATE_DIR"]) / "state.json").exists()


def test_up_ha_serves_through_a_killed_primary_and_down_stops_all_six(clean_env):
    """`replicadp up --ha` starts a primary, two replicas and three Sentinels (each under a supervisor, the
    password on no command line) and writes a Sentinel URL; `status`-style clients and a replica use it. SIGKILL
    of the primary's server process: a request sent after it is served (through the restarted server or a
    promoted replica, whichever comes first). `down` leaves no supervisor, server or Sentinel behind."""
    env, tmp = clean_env
    up = subprocess.run([REPLICADP, "up", "--ha", "--replicas", "1", "--devices", "cpu", "--threads", "1",
                         "--model", SYNTHETIC], env=env, capture_output=True, text=True, timeout=300)
    supervisors = []
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        state = json.loads((Path(env["REPLICADP_STATE_DIR"]) / "state.json").read_text())
        assert state["redis_url"].startswith("sentinel://") and "master_name=replicadp" in state["redis_url"]
        supervisors = [s["pid"] for s in state["servers"]]
        assert [Path(s["conf"]).name for s in state["servers"]] == ["sentinel.conf"] * 3 + ["valkey.conf"] * 3
        password = connection.parse(state["redis_url"]).password
        for pid in supervisors + [c for p in supervisors for c in children(p)]:
            assert password.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
        primary = connection.client(state["redis_url"], socket_timeout=5)
        os.kill(int(primary.info("server")["process_id"]), signal.SIGKILL)

        assert served_by(env) == state["replicas"][0]
    finally:
        down = subprocess.run([REPLICADP, "down"], env=env, capture_output=True, text=True, timeout=120)
    assert down.returncode == 0 and "stopped 1 replica" in down.stdout, down.stdout + down.stderr
    assert not any(Path(f"/proc/{pid}").exists() for pid in supervisors)
    assert started_with(tmp) == set()


def test_down_cleans_up_after_a_vanished_supervisor(clean_env, tmp_path):
    """A state file whose server supervisor and launcher are gone (their PIDs free, or reused by a process that
    is neither) still lets `down` finish: it signals nothing that is not one of them, and removes the state."""
    env, tmp = clean_env
    state_dir = Path(env["REPLICADP_STATE_DIR"])
    state_dir.mkdir()
    bystander = subprocess.Popen(["sleep", "60"], env=env)  # stands in for a process that took the PID
    try:
        conf = tmp_path / "run" / "redis" / "valkey.conf"
        conf.parent.mkdir(parents=True)
        (conf.parent / "supervisor.pid").write_text(f"{bystander.pid}\n")
        (state_dir / "state.json").write_text(json.dumps({
            "run_dir": str(tmp_path / "run"), "model": "tiny", "replicas": ["replica0@x"],
            "redis_url": "redis://:x@127.0.0.1:1/0", "servers": [{"pid": bystander.pid, "conf": str(conf)}],
            "launcher_pid": bystander.pid}))
        down = subprocess.run([REPLICADP, "down"], env=env, capture_output=True, text=True, timeout=60)
        assert down.returncode == 0 and "stopped 1 replica" in down.stdout, down.stdout + down.stderr
        assert bystander.poll() is None
        assert not (state_dir / "state.json").exists()
    finally:
        bystander.kill()
        bystander.wait()
    assert started_with(tmp) == set()


def test_embedded_server_wants_the_password_and_listens_on_loopback(redis_server):
    """A connection without the password is refused; the server binds 127.0.0.1 and keeps an append-only file."""
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(host="127.0.0.1", port=redis_server.port).ping()
    client = redis.Redis.from_url(redis_server.url)
    assert client.config_get("bind")["bind"] == "127.0.0.1"
    assert client.config_get("appendonly")["appendonly"] == "yes"
    assert client.config_get("appendfsync")["appendfsync"] == "always"


def test_demo_whose_first_phase_fails_every_request_says_why_and_cleans_up(clean_env, tmp_path, tiny_model):
    """A demo whose every 1-replica request fails (48x48: a size the tiny model's replica refuses, not being a
    multiple of 32) ends with exit 1 and one line naming the phase and the first request's error, without a
    traceback, and leaves no process or temp folder behind."""
    env, tmp = clean_env
    run = subprocess.run([REPLICADP, "demo", "--num-requests", "2", "--size", "48x48", "--num-frames", "9",
                          "--steps", "4", "--output-dir", str(tmp_path / "videos")], env=env, capture_output=True,
                         text=True, timeout=300)
    output = run.stdout + run.stderr
    assert run.returncode == 1, output
    assert "Error: every request of the 1-replica phase failed: InvalidRequest: " in run.stderr, output
    assert "=48: must be a multiple of 32 for this model" in run.stderr, output
    assert "Traceback" not in output
    assert started_with(tmp) == set()
    assert list(tmp.iterdir()) == []
