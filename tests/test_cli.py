"""The `replicadp` command's conventions, run as a user runs it against real replicas: `--version`, one-shot
`generate` / `get` / `cancel`, `--json -` on stdout, exit statuses, `up`'s defaults; and a replica that refuses
to start when Celery's broker is not the Redis of REDIS_URL."""

import hashlib
import importlib.metadata
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import av
import pytest
import redis
from click.testing import CliRunner

from client.api import _app_for, live_replicas
from client.cli import main
from client.local.embedded import EmbeddedServer
from client.local.replicas import Replicas, fleet_plan, plan, stop_group
from conftest import SESSION_DIR, start_replicas
from helpers import SYNTHETIC, declared, lasting, wait_for
from replicadp_tasks.contract import RequestState
from replicadp_tasks.app import redis_address
from replicadp_tasks.cluster.heartbeat import Heartbeat
from replicadp_tasks.settings import reference
from test_embedded import REPLICADP, started_with

CELERY = str(Path(sys.executable).parent / "celery")
SMALL = ["--size", "64x64", "--num-frames", "9", "--steps", "4"]


def cli(*args, redis_url, timeout=300):
    return subprocess.run([REPLICADP, *args], env={**os.environ, "REDIS_URL": redis_url}, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def served(redis_db, tiny_model):
    """One tiny-model replica on a DB of its own; its URL."""
    url = redis_db()
    group = start_replicas(1, url, "cli", OUTPUT_DIR=str(SESSION_DIR / "outputs-cli"))
    yield url
    group.stop()


def test_version():
    """`replicadp --version` prints the installed distribution's version and exits 0."""
    run = subprocess.run([REPLICADP, "--version"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == f"replicadp, version {importlib.metadata.version('replicadp')}"


def test_generate_writes_a_playable_mp4(served, tmp_path):
    """`generate PROMPT -o FILE` waits for the request and writes an MP4 that decodes to the frames asked for,
    and prints a summary of it."""
    out = tmp_path / "fox.mp4"
    run = cli("generate", "a red fox in snow", "-o", str(out), *SMALL, "--seed", "3", redis_url=served)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "completed" in run.stdout and f"wrote {out}" in run.stdout and "64x64, 9 frames, 4 steps" in run.stdout
    with av.open(str(out)) as container:
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    assert len(frames) == 9 and frames[0].shape == (64, 64, 3)


def test_generate_json_then_get_it_by_id(served, tmp_path):
    """`generate --json` prints the Result alone on stdout; `get ID` finds it completed, `get ID --json` gives the
    same Result and `get ID -o FILE` writes the very MP4 the Result's hash names."""
    run = cli("generate", "a blue whale", *SMALL, "--seed", "5", "--priority", "interactive", "--user", "ann",
              "--json", redis_url=served)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(run.stdout)
    assert {"request_id", "replica", "model", "params", "frames_sha256", "video_sha256", "timings",
            "video_uri"} <= set(result)
    assert result["params"]["seed"] == 5 and result["params"]["num_frames"] == 9 and result["model"] == "tiny"
    assert "completed" in run.stderr  # the summary, off stdout
    rid = result["request_id"]

    got = cli("get", rid, redis_url=served)
    assert got.returncode == 0 and f"{rid}: completed on {result['replica']}" in got.stdout, got.stdout + got.stderr
    view = json.loads(cli("get", rid, "--json", redis_url=served).stdout)
    assert view["status"] == "completed" and view["result"] == result
    copy = tmp_path / "copy.mp4"
    assert cli("get", rid, "-o", str(copy), redis_url=served).returncode == 0
    assert hashlib.sha256(copy.read_bytes()).hexdigest() == result["video_sha256"]


def test_json_dash_is_stdout_for_bench_and_describe_model(served):
    """`bench --json -` and `describe-model --json -` print the JSON alone on stdout, their tables on stderr."""
    bench = cli("bench", "--num-requests", "1", "--concurrency", "1", "--warmup", "0", *SMALL, "--json", "-",
                redis_url=served)
    assert bench.returncode == 0, bench.stdout + bench.stderr
    assert json.loads(bench.stdout)["completed"] == 1 and "videos/min" in bench.stderr
    described = cli("describe-model", "tiny", "--json", "-", redis_url=served)
    assert described.returncode == 0, described.stderr
    assert json.loads(described.stdout) and described.stderr.strip()


def test_bad_options_are_usage_errors_naming_the_option(redis_db):
    """A malformed --size, a size the request check refuses, a step count out of range or a missing --image
    file: exit 2 before anything is sent, naming the option and the value."""
    url = redis_db()
    for args, option, value in ((["--size", "64by64"], "--size", "64by64"), (["--size", "100x100"], "--size", "100"),
                                (["--steps", "0"], "--steps", "0"), (["--image", "nope.png"], "--image", "nope.png")):
        run = cli("generate", "x", *args, redis_url=url)
        assert run.returncode == 2 and f"Invalid value for '{option}'" in run.stderr and value in run.stderr, run.stderr


def test_sizes_and_qualities_are_checked_against_the_live_replicas(served, tmp_path):
    """Against a tiny-model replica (Wan2.2-TI2V: sizes in multiples of 32) without a step cache: a height of 48
    (a multiple of 16) and quality=fast are usage errors (exit 2) naming the option, the field, the value and what
    the replicas take, before anything is sent; a batch file with such a line is refused as malformed (exit 1),
    naming the line, before anything is sent (before, both were sent and failed on the replica)."""
    run = cli("generate", "x", "--size", "64x48", "--num-frames", "9", "--steps", "4", redis_url=served)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "Invalid value for '--size': height=48: must be a multiple of 32" in run.stderr and "sent" not in run.stderr
    fast = cli("generate", "x", *SMALL, "--quality", "fast", redis_url=served)
    assert fast.returncode == 2, fast.stdout + fast.stderr
    assert "Invalid value for '--quality': quality='fast': not served here: these replicas serve standard only" in \
        fast.stderr and "sent" not in fast.stderr
    batch = tmp_path / "batch.jsonl"
    batch.write_text(json.dumps({"prompt": "x", "width": 64, "height": 48, "num_frames": 9,
                                 "num_inference_steps": 4}) + "\n")
    sub = cli("submit", str(batch), redis_url=served)
    assert sub.returncode == 1 and "line 1: height=48: must be a multiple of 32" in sub.stderr, sub.stdout + sub.stderr
    assert not (tmp_path / "batch.jsonl.results.jsonl").exists()


def test_status_shows_each_replicas_fast_path(served, redis_db):
    """`status --json` and its table say per replica whether it serves quality=fast and with which step cache:
    the module's replica (no cache) serves standard only, no fast path; one started with
    REPLICADP_CACHE=first-block serves both, with `first-block threshold=0.05` (diffusers' default threshold)."""
    plain = cli("status", "--json", redis_url=served)
    assert plain.returncode == 0, plain.stderr
    assert [(r["qualities"], r["fast_path"]) for r in json.loads(plain.stdout)["replicas"]] == [(["standard"], None)]
    url = redis_db()
    group = start_replicas(1, url, "cli-fast", REPLICADP_CACHE="first-block")
    try:
        cached = cli("status", "--json", redis_url=url)
        shown = cli("status", redis_url=url)
    finally:
        group.stop()
    assert cached.returncode == 0 and shown.returncode == 0, cached.stderr + shown.stderr
    assert [(r["name"], r["qualities"], r["fast_path"]) for r in json.loads(cached.stdout)["replicas"]] == \
        [(group.names[0], ["standard", "fast"], "first-block threshold=0.05")]
    assert "fast path" in shown.stdout and "first-block threshold=0.05" in shown.stdout, shown.stdout


def test_serve_http_on_a_busy_port_says_so(redis_db):
    """serve-http on an address something already listens on exits 5 (Exit.PORT_IN_USE) before it starts, saying
    which address is in use (before: uvicorn's bind error in the log, and 3, the status of an unreachable Redis)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = cli("serve-http", "--port", str(port), redis_url=redis_db(), timeout=60)
    assert run.returncode == 5 and f"127.0.0.1:{port} is in use" in run.stderr, run.stdout + run.stderr


def test_generate_without_replicas_or_redis_is_unavailable(redis_db):
    """Exit 3 (nothing was run) with a clear message: no live replica on a Redis, or no Redis at all (its password
    hidden)."""
    none = cli("generate", "x", *SMALL, redis_url=redis_db())
    assert none.returncode == 3 and "no live replica" in none.stderr and "replicadp up" in none.stderr, none.stderr
    down = cli("generate", "x", *SMALL, redis_url="redis://:secret@127.0.0.1:1/0")
    assert down.returncode == 3 and "cannot reach Redis at redis://:***@127.0.0.1:1/0" in down.stderr
    assert "secret" not in down.stderr


def test_get_and_cancel_a_queued_then_a_running_request(redis_db, tmp_path):
    """A request sent while no replica is live is `queued` to `get`; `cancel` says it was queued, and once a
    replica starts it fails as cancelled (`get`: exit 1), a second cancel has nothing to do. A running request is
    `running` with its replica and step, and `cancel` says so and stops it. An unknown id is exit 4."""
    url = declared(redis_db(), SYNTHETIC)
    app = _app_for(url)
    queued = app.send_task("replicadp.generate", kwargs=lasting(0.25, prompt="queued")).id
    got = cli("get", queued, redis_url=url)
    assert got.returncode == 0 and f"{queued}: queued" in got.stdout, got.stdout + got.stderr
    assert json.loads(cli("get", queued, "--json", redis_url=url).stdout)["status"] == "queued"
    cancelled = cli("cancel", queued, redis_url=url)
    assert cancelled.returncode == 0 and "it was queued and will not run" in cancelled.stdout, cancelled.stdout
    for command in ("get", "cancel"):
        unknown = cli(command, "no-such-request", redis_url=url)
        assert unknown.returncode == 4 and "no-such-request: unknown" in unknown.stdout, unknown.stdout

    group = start_replicas(1, url, "cli-cancel", model=SYNTHETIC, OUTPUT_DIR=str(tmp_path))
    try:
        wait_for(lambda: app.backend.get_task_meta(queued)["status"] == RequestState.FAILURE,
                 "the cancelled request to fail")
        failed = cli("get", queued, redis_url=url)
        assert failed.returncode == 1 and "failed: RequestCancelled" in failed.stdout, failed.stdout
        again = cli("cancel", queued, redis_url=url)
        assert again.returncode == 0 and "nothing to cancel, it has ended (failed)" in again.stdout, again.stdout

        running = app.send_task("replicadp.generate", kwargs=lasting(40, prompt="long")).id
        wait_for(lambda: app.backend.get_task_meta(running)["status"] == RequestState.PROGRESS, "it to run")
        view = json.loads(cli("get", running, "--json", redis_url=url).stdout)
        assert view["status"] == "running" and view["replica"] == group.names[0] and view["total_steps"] == 160
        stopped = cli("cancel", running, redis_url=url)
        assert stopped.returncode == 0 and f"it was running on {group.names[0]}" in stopped.stdout, stopped.stdout
        meta = wait_for(lambda: (m := app.backend.get_task_meta(running))["status"] == RequestState.FAILURE and m,
                        "the running request to stop")
        assert type(meta["result"]).__name__ == "RequestCancelled"
    finally:
        group.stop()


def test_up_takes_the_model_from_the_environment_and_falls_back_to_the_cpu(clean_env):
    """With no --model, --devices or --replicas, `up` serves REPLICADP_MODEL, finds no visible GPU (an empty
    CUDA_VISIBLE_DEVICES) and starts one CPU replica, and says so."""
    env, tmp = clean_env
    env.update(REPLICADP_MODEL=SYNTHETIC, CUDA_VISIBLE_DEVICES="")
    up = subprocess.run([REPLICADP, "up", "--threads", "1"], env=env, capture_output=True, text=True, timeout=300)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert f"up: 1 replica(s) of {SYNTHETIC!r} on the CPU (--devices auto)" in up.stdout, up.stdout
        state = json.loads((Path(env["REPLICADP_STATE_DIR"]) / "state.json").read_text())
        assert state["models"] == [SYNTHETIC] and len(state["replicas"]) == 1
    finally:
        down = subprocess.run([REPLICADP, "down"], env=env, capture_output=True, text=True, timeout=120)
    assert down.returncode == 0 and "stopped 1 replica" in down.stdout
    assert started_with(tmp) == set()


def test_up_refuses_bad_devices_and_a_model_it_cannot_load(clean_env):
    """Bad --devices or --replicas are usage errors (exit 2) naming them; a model spec the replica cannot load
    ends `up` at the replica's first exit (exit 1, with the replica's error), not after its load timeout, and
    leaves nothing running."""
    env, tmp = clean_env
    for args, extra, message in ((["--devices", "0,x"], {}, "--devices '0,x'"),
                                 (["--replicas", "0"], {}, "--replicas 0"),
                                 (["--replicas", "2"], {"CUDA_VISIBLE_DEVICES": "0"}, "1 GPU(s) visible (0)")):
        run = subprocess.run([REPLICADP, "up", *args], env={**env, **extra}, capture_output=True, text=True,
                             timeout=60)
        assert run.returncode == 2 and message in run.stderr, run.stderr
    env.update(REPLICADP_MODEL="./no-such-model", CUDA_VISIBLE_DEVICES="")
    run = subprocess.run([REPLICADP, "up", "--threads", "1"], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "a replica exited before it served" in run.stderr and "no such folder" in run.stderr, run.stderr
    assert not (Path(env["REPLICADP_STATE_DIR"]) / "state.json").exists()
    assert started_with(tmp) == set()


def test_up_plans_one_replica_per_visible_gpu():
    """`up`'s device plan: no visible GPU is the CPU; else one replica per --gpus-per-replica visible GPUs, or
    the first GPUs that --replicas needs; too few GPUs, or a device that is not an id, is refused by name."""
    assert plan("auto", None, 1, []) == ("cpu", 1)
    assert plan("auto", None, 1, ["0", "1", "2", "3"]) == ("0,1,2,3", 4)
    assert plan("auto", None, 2, ["4", "5", "6", "7"]) == ("4,5,6,7", 2)
    assert plan("auto", 1, 1, ["2", "3"]) == ("2", 1)
    assert plan("0,1", None, 1, []) == ("0,1", 2)
    assert plan("cpu", 3, 1, ["0"]) == ("cpu", 3)
    with pytest.raises(ValueError, match="too few for 3 replica"):
        plan("auto", 3, 1, ["0", "1"])
    with pytest.raises(ValueError, match="'0,x'"):
        plan("0,x", None, 1, [])


def test_up_plans_a_fleet_one_model_after_another():
    """`up` with several --model: each --replicas, --devices, --served-model-name goes with the --model in its place
    (one value: with every model); `auto` gives each model the visible GPUs the ones before left; a GPU given to two
    models, two models under one name, a name that is none, or counts that do not pair are refused by name."""
    groups = fleet_plan(("tiny", "tiny-a14b"), (), (2, 1), (), 1, ["0", "1", "2", "3"])
    assert [(g.model, g.n, g.devices, g.served_name) for g in groups] == \
        [("tiny", 2, "0,1", None), ("tiny-a14b", 1, "2", None)]
    groups = fleet_plan(("tiny", "tiny"), ("draft", "final"), (1,), ("cpu",), 1, [])
    assert [(g.n, g.devices, g.served_name) for g in groups] == [(1, "cpu", "draft"), (1, "cpu", "final")]
    for args, message in (((("tiny", "tiny"), (), (1,), ("cpu",)), "two --model serve 'tiny'"),
                          ((("a", "b", "c"), (), (1, 2), ()), "--replicas given 2 times for 3 --model"),
                          ((("a", "b"), (), (1,), ("0", "0,1")), "GPU 0 is given to another --model"),
                          ((("a b",), (), (), ("cpu",)), "--model='a b': is not a model's name")):
        with pytest.raises(ValueError, match=re.escape(message)):
            fleet_plan(*args, 1, ["0", "1"])


def test_up_starts_two_models_and_down_stops_both(clean_env):
    """`up --model A --served-model-name a --model A --served-model-name b` on the CPU: two launchers, replica0
    serving `a` and replica1 serving `b`, both in `status --json`; `down` stops both and leaves nothing running."""
    env, tmp = clean_env
    env.update(CUDA_VISIBLE_DEVICES="")
    up = subprocess.run([REPLICADP, "up", "--threads", "1", "--model", SYNTHETIC, "--served-model-name", "a",
                         "--model", SYNTHETIC, "--served-model-name", "b"], env=env, capture_output=True, text=True,
                        timeout=300)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert "up: 2 replica(s) serving 'a', 'b'" in up.stdout, up.stdout
        status = subprocess.run([REPLICADP, "status", "--json"], env=env, capture_output=True, text=True, timeout=60)
        snap = json.loads(status.stdout)
        assert {m["name"]: m["serving"] for m in snap["models"]} == {"a": 1, "b": 1}, snap["models"]
        assert {r["name"].split("@")[0]: r["model"] for r in snap["replicas"]} == {"replica0": "a", "replica1": "b"}
    finally:
        down = subprocess.run([REPLICADP, "down"], env=env, capture_output=True, text=True, timeout=120)
    assert down.returncode == 0 and "stopped 2 replica" in down.stdout
    assert started_with(tmp) == set()


def test_starting_replicas_outlasts_a_redis_read_that_times_out(tmp_path):
    """While replicas start, `up` and the tests poll the heartbeats with a 1 s read. A server that stalls past
    it (CLIENT PAUSE here; an fsync on a busy disk in CI) makes that read time out: the poll counts it as no
    replica serving yet and asks again, instead of failing the start."""
    server = EmbeddedServer(tmp_path / "redis")
    url = server.start()
    try:
        group = Replicas(1, redis_url=url, model="tiny", log_path=tmp_path / "replicas.log")
        Heartbeat(group.names[0], url, 10.0, consuming=lambda: True, running=lambda: None, models=["tiny"],
                  prefix="video").beat(True, None)
        assert group.serving() == set(group.names)
        pause = redis.Redis.from_url(url)
        pause.client_pause(1500, all=True)
        with pytest.raises(redis.exceptions.TimeoutError):
            live_replicas(url=url)  # the read the poll makes, past its 1 s
        pause.client_pause(1500, all=True)
        assert group.serving() == set()
        assert group.serving() == set(group.names)  # the pause over, the same read answers
    finally:
        server.stop()


def test_redis_urls_compare_by_what_they_name():
    """Default port and DB, host case and a DB given as ?db= are the same Redis; another DB, port, password or
    host name (localhost is not 127.0.0.1: nothing is resolved) is another."""
    same = redis_address("redis://:pw@127.0.0.1:6379/0")
    assert redis_address("redis://:pw@127.0.0.1") == same
    assert redis_address("redis://:pw@127.0.0.1:6379?db=0") == same
    assert redis_address("redis://:pw@127.0.0.1:6379/") == same
    for other in ("redis://:pw@127.0.0.1:6379/1", "redis://:pw@127.0.0.1:6380/0", "redis://:other@127.0.0.1/0",
                  "redis://:pw@localhost/0", "rediss://:pw@127.0.0.1/0"):
        assert redis_address(other) != same, other
    assert redis_address("redis://:pw@LOCALHOST/0") == redis_address("redis://:pw@localhost/0")


def celery_worker(url: str, name: str, log: Path, *celery_args: str, **env) -> subprocess.Popen:
    """`celery -A replicadp_tasks [celery_args] worker -n NAME@%h` with REDIS_URL=url, as worker_launch.sh starts
    a replica (synthetic backend, CPU), in a process group of its own, its output in `log`."""
    with open(log, "w") as out:
        return subprocess.Popen([CELERY, "-A", "replicadp_tasks", *celery_args, "worker", "-n", f"{name}@%h"],
                                env={**os.environ, "REDIS_URL": url, "REPLICADP_MODEL": SYNTHETIC,
                                     "CUDA_VISIBLE_DEVICES": "", **env},
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)


def test_a_replica_refuses_a_broker_other_than_its_redis(redis_db, tmp_path):
    """`celery -A replicadp_tasks -b URL worker`, CELERY_BROKER_URL or CELERY_RESULT_BACKEND naming another Redis
    than REDIS_URL: the replica exits non-zero before it consumes, naming both (passwords hidden) and the fix;
    with the same URL given both ways it starts and serves."""
    url = redis_db()
    db = int(url.rsplit("/", 1)[1])
    other = f"{url.rsplit('/', 1)[0]}/{db + 100}"
    password = urlsplit(url).password
    log = tmp_path / "worker.log"
    for what, args, env in (("broker", ["-b", other], {}), ("broker", [], {"CELERY_BROKER_URL": other}),
                            ("result backend", [], {"CELERY_RESULT_BACKEND": other})):
        proc = celery_worker(url, "refused", log, *args, **env)
        try:
            proc.wait(timeout=120)
        finally:
            stop_group(proc.pid, 10, proc)
        output = log.read_text()
        assert proc.returncode != 0, output
        assert f"Celery's {what} is 'redis://:***@127.0.0.1:" in output and f"/{db + 100}'" in output, output
        assert "replicadp's Redis (REDIS_URL, else `replicadp up`'s server) is 'redis://:***@" in output
        assert "set REDIS_URL" in output and password not in output

    proc = celery_worker(url, "matching", log, "-b", url, "--result-backend", url)
    try:
        wait_for(lambda: any(n.startswith("matching@") for n in live_replicas(url=url)), "the replica to serve",
                 timeout=180)
    finally:
        stop_group(proc.pid, 60, proc)
        proc.wait()


def test_a_producer_refuses_a_broker_other_than_its_redis(redis_db):
    """A client whose CELERY_BROKER_URL or CELERY_RESULT_BACKEND names another Redis than its REDIS_URL (Celery lets
    those variables win over the configured URLs) sends nothing: `run_requests` in a process of its own, and
    `replicadp generate --redis-url` (with the variable naming REDIS_URL's Redis), exit 1 naming both URLs with
    their passwords hidden and the fix, without a traceback, and the other Redis stays empty."""
    url, other = redis_db(), redis_db()
    password = urlsplit(url).password
    code = ("from client.api import run_requests; "
            "print([o.error for o in run_requests([{'prompt': 'x'}], concurrency=1, timeout=3)])")
    runs = [(what, subprocess.run([sys.executable, "-c", code], env={**os.environ, "REDIS_URL": url, variable: other},
                                  capture_output=True, text=True, timeout=120))
            for what, variable in (("broker", "CELERY_BROKER_URL"), ("result backend", "CELERY_RESULT_BACKEND"))]
    runs.append(("broker", subprocess.run(
        [REPLICADP, "generate", "x", *SMALL, "--timeout", "3", "--redis-url", url],
        env={**os.environ, "REDIS_URL": other, "CELERY_BROKER_URL": other}, capture_output=True, text=True,
        timeout=120)))
    for what, run in runs:
        output = run.stdout + run.stderr
        assert run.returncode == 1, output
        assert f"replicadp: Celery's {what} is 'redis://:***@127.0.0.1:" in run.stderr, output
        assert f"/{other.rsplit('/', 1)[1]}', but replicadp's Redis (REDIS_URL, else `replicadp up`'s server) is " \
               f"'redis://:***@127.0.0.1:{urlsplit(url).port}/{url.rsplit('/', 1)[1]}'" in run.stderr, output
        assert "set REDIS_URL" in run.stderr and password not in output and "Traceback" not in output
        assert redis.Redis.from_url(other).dbsize() == 0


def test_demo_and_sweep_take_redis_url_over_the_environment(redis_db, clean_env, tmp_path, tiny_model):
    """`sweep --redis-url URL` and `demo --redis-url URL` run their replicas and requests on URL, not on REDIS_URL
    (here a port nothing listens on), and start no server of their own: the sweep completes with its results in
    URL's DB; the demo's requests reach its replica there (each refused for its size, the replica's own error).
    Neither leaves a process or temp folder behind."""
    env, tmp = clean_env
    env["REDIS_URL"] = "redis://127.0.0.1:1/0"
    url = redis_db()
    out = tmp_path / "res" / "sweep"
    sweep = subprocess.run([REPLICADP, "sweep", "--redis-url", url, "--replicas", "1", "--model", SYNTHETIC,
                            "--size", "64x64", "--num-frames", "5", "--steps", "2", "--num-requests", "2", "--out",
                            str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert sweep.returncode == 0, sweep.stdout + sweep.stderr
    assert [r["completed"] for r in json.loads(out.with_suffix(".json").read_text())] == [2]
    assert redis.Redis.from_url(url).keys("celery-task-meta-*")
    demo = subprocess.run([REPLICADP, "demo", "--redis-url", url, "--num-requests", "2", "--size", "48x48",
                           "--num-frames", "9", "--steps", "4", "--output-dir", str(tmp_path / "videos")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert demo.returncode == 1, demo.stdout + demo.stderr
    assert "every request of the 1-replica phase failed: InvalidRequest: " in demo.stderr, demo.stderr
    assert "embedded Valkey" not in demo.stdout
    assert started_with(tmp) == set()
    assert list(tmp.iterdir()) == []


def test_settings_table_and_the_configuration_doc():
    """docs/configuration.md is exactly what `replicadp settings --markdown` prints now (rewrite it with that
    command when a setting changes), so that the doc cannot go stale; and the plain `replicadp settings` table
    names every variable, REPLICADP_MODEL among them, with a webhook secret set in its environment shown as ***,
    never its value."""
    doc = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
    printed = CliRunner().invoke(main, ["settings", "--markdown"])
    assert printed.exit_code == 0, printed.output
    assert doc.read_bytes() == printed.stdout_bytes, "docs/configuration.md is stale: rewrite it with " \
        "`replicadp settings --markdown > docs/configuration.md`"
    secret = "not-to-be-printed-4f1c"
    run = subprocess.run([REPLICADP, "settings"], env={**os.environ, "REPLICADP_WEBHOOK_SECRET": secret},
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in run.stdout.splitlines()
            if line.startswith("│") and line.split("│")[1].strip()}
    assert "REPLICADP_MODEL" in rows and set(rows) == {s.variable for s in reference()}
    assert rows["REPLICADP_WEBHOOK_SECRET"] == "***" and secret not in run.stdout + run.stderr
