"""Faults with real processes: killed pool children and replicas, SIGTERM, time limits, out of memory, a Redis
restart, and concurrent deliveries of one request. Nothing is lost, and nothing is computed twice."""

import json
import os
import signal
import time
from pathlib import Path

import pytest
import redis

from replicadp_tasks import app, generate
from replicadp_tasks.errors import PoisonRequest
from replicadp_tasks.lease import LOCK_KEY
from replicadp_tasks.settings import SETTINGS
from replicadp_tasks.worker import ATTEMPTS_KEY, DEAD_KEY, REPLICA_KEY, STATS_KEY

SLOW = {"height": 128, "width": 128, "num_frames": 17, "num_inference_steps": 30}  # ~1-2 s on the tiny model
# The same budget as SLOW, spent on more, smaller steps: a few seconds, with a PROGRESS report every step.
# What a replica serves after a fault: the smallest request.
SHORT = {"prompt": "short", "height": 64, "width": 64, "num_frames": 5, "num_inference_steps": 2}
LONG = {"height": 64, "width": 64, "num_frames": 17, "num_inference_steps": 120}


def parent_of(pid: int) -> int:
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])


def wait_for_step(task_id: str, step: int, timeout: float = 60.0) -> dict:
    """The PROGRESS info of `task_id` once it has reached `step`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        meta = app.backend.get_task_meta(task_id)
        if meta["status"] == "PROGRESS" and meta["result"]["step"] >= step:
            return meta["result"]
        time.sleep(0.01)
    raise TimeoutError(f"{task_id} did not reach step {step}")


def running_pid(task_id: str, not_pids=(), timeout: float = 60.0) -> int:
    """The pid of the pool child running `task_id`, once it is not one of `not_pids`. Read from PROGRESS, not
    STARTED: STARTED is stored before the task body counts the attempt, and a kill in between would be an
    attempt the poison bound never counts, and the test would wait for a poison failure that comes a start later."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        meta = app.backend.get_task_meta(task_id)
        info = meta.get("result")
        if meta["status"] == "PROGRESS" and isinstance(info, dict) and info.get("pid") not in not_pids:
            return info["pid"]
        time.sleep(0.01)
    raise TimeoutError(f"{task_id} did not start")


def wait_for_reload(replica: str, old_pid: int, timeout: float = 120.0) -> None:
    """Wait until `replica` has a new pool child with its model loaded."""
    client = redis.Redis.from_url(app.conf.broker_url)
    deadline = time.monotonic() + timeout
    while json.loads(client.get(REPLICA_KEY + replica))["pid"] == old_pid:
        assert time.monotonic() < deadline, f"{replica} did not reload"
        time.sleep(0.1)


def restart_redis(server, folder, down_s: float):
    """SIGKILL the embedded server, and after `down_s` start it again on the same port from its append-only
    file; returns the new server."""
    from client.embedded import EmbeddedServer

    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait()
    time.sleep(down_s)
    server = EmbeddedServer(folder, port=server.port, password=server.password)
    server.start()
    return server


def serve_again(replicas):
    """Both replicas serve again (a killed child is replaced and reloads its model)."""
    results = [generate.delay(prompt="after", seed=s, height=64, width=64, num_frames=5, num_inference_steps=2)
               for s in range(4)]
    assert all(r.get(timeout=120)["replica"] in replicas.names for r in results)


def test_killed_pool_child_requeues_its_request(replicas):
    """SIGKILL of the pool child mid-request (an OOM kill): the request goes back to the head of the queue and
    completes within 5 s of the kill on the other replica, which is ready (the killed child's replica stops
    taking requests while its replacement child reloads the model); the caller's get() returns the success,
    not WorkerLostError. Once reloaded, that replica consumes the shared queue again."""
    result = generate.delay(prompt="survive a kill", seed=9, **SLOW)
    info = wait_for_step(result.id, 1)
    pid, replica = info["pid"], info["replica"]
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    meta = result.get(timeout=120)
    recovered = time.monotonic() - killed
    print(f"\nrequeued and completed on {meta['replica']} {recovered:.1f} s after the kill")
    assert meta["params"]["seed"] == 9 and len(meta["frames_sha256"]) == 64
    assert meta["replica"] != replica
    assert recovered < 5
    wait_for_reload(replica, pid)  # loaded: it now asks its main process to consume, which takes a moment
    deadline = time.monotonic() + 30
    while SETTINGS.queue not in {q["name"] for q in (app.control.inspect(destination=[replica], timeout=5)
                                                     .active_queues() or {}).get(replica, [])}:
        assert time.monotonic() < deadline, f"{replica} reloaded but does not consume {SETTINGS.queue}"
        time.sleep(0.2)
    serve_again(replicas)


def test_poison_request_is_failed_after_max_attempts(replicas):
    """A request whose every start ends its process (here: SIGKILL at each start) is started at most
    REPLICADP_MAX_ATTEMPTS (3) times, then fails with PoisonRequest and is recorded as dead."""
    result = generate.delay(prompt="poison", seed=13, **SLOW)
    pids = []
    for _ in range(3):
        pid = running_pid(result.id, pids)
        pids.append(pid)
        os.kill(pid, signal.SIGKILL)
    with pytest.raises(PoisonRequest, match="ended its replica's process 3 times"):
        result.get(timeout=120)
    dead = [json.loads(r) for r in redis.Redis.from_url(app.conf.broker_url).lrange(DEAD_KEY, 0, -1)]
    assert any(d["task_id"] == result.id and d["attempts"] == 3 and d["kwargs"]["prompt"] == "poison" for d in dead)
    serve_again(replicas)



def test_killed_replica_request_completes_on_another(replicas):
    """SIGKILL of a replica's main process mid-request (its pool child dies with it): the replica's heartbeat
    expires, another replica's sweep requeues the request within the lease (6 s), and that replica completes it
    within 15 s of the kill; Redis's visibility timeout (35 min here) plays no part. The request was started
    twice and computed once."""
    result = generate.delay(prompt="survive a replica kill", seed=21, **LONG)
    info = wait_for_step(result.id, 3)
    os.kill(parent_of(info["pid"]), signal.SIGKILL)
    killed = time.monotonic()
    meta = result.get(timeout=60)
    recovered = time.monotonic() - killed
    print(f"\nreplica {info['replica']} killed at step {info['step']}; completed on {meta['replica']} "
          f"{recovered:.1f} s after the kill")
    assert meta["replica"] != info["replica"] and meta["params"]["seed"] == 21
    assert recovered < 15
    client = redis.Redis.from_url(app.conf.broker_url)
    assert int(client.get(ATTEMPTS_KEY + result.id)) == 2
    serve_again(replicas)  # the launcher restarted the killed one


def test_sigterm_mid_request_finishes_it_first(replicas):
    """SIGTERM to a replica mid-request (a deploy): the replica finishes the request, then exits; the request
    succeeds on that replica, once, and is never marked failed. The launcher starts the replica again."""
    result = generate.delay(prompt="finish before exit", seed=22, **LONG)
    info = wait_for_step(result.id, 3)
    main = parent_of(info["pid"])
    os.kill(main, signal.SIGTERM)
    meta = result.get(timeout=60)
    assert meta["replica"] == info["replica"] and not meta["redelivered"]
    assert int(redis.Redis.from_url(app.conf.broker_url).get(ATTEMPTS_KEY + result.id)) == 1
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{main}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{main}"), "the replica did not exit after its request"
    serve_again(replicas)


def test_concurrent_deliveries_of_one_request_compute_once(replicas):
    """Two deliveries of one request_id at once (two replicas): the fence lets one compute while the other waits
    and returns the stored result; both report the same execution and video, and no second computation is
    counted."""
    client = redis.Redis.from_url(app.conf.broker_url)
    before = int(client.hget(STATS_KEY, "duplicate_executions") or 0)
    args = dict(prompt="one request, two deliveries", seed=23, request_id="fenced-once", **SLOW)
    first, second = generate.delay(**args), generate.delay(**args)
    a, b = first.get(timeout=120), second.get(timeout=120)
    assert a["execution"] == b["execution"] and a["video_uri"] == b["video_uri"]
    assert sorted([a["redelivered"], b["redelivered"]]) == [False, True]
    assert int(client.hget(STATS_KEY, "duplicate_executions") or 0) == before
    assert client.get(LOCK_KEY + "fenced-once") is None  # released


def test_launcher_restarts_a_dead_replica(redis_server, tmp_path):
    """worker_launch.sh supervises: a replica whose main process is SIGKILLed comes back with the same name,
    loads its model again and serves; the restart is reported in the launcher's log."""
    from client.api import live_replicas
    from conftest import start_replicas
    from replicadp_tasks.worker import REPLICA_KEY

    url = redis_server.url[:-1] + "3"
    group = start_replicas(1, url, "supervised", OUTPUT_DIR=str(tmp_path))
    try:
        client = redis.Redis.from_url(url)
        name = group.names[0]
        child = json.loads(client.get(REPLICA_KEY + name))["pid"]
        os.kill(parent_of(child), signal.SIGKILL)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            info = json.loads(client.get(REPLICA_KEY + name))
            if info["pid"] != child and name in live_replicas(url=url):
                break
            time.sleep(0.2)
        else:
            pytest.fail("the replica did not come back")
        log = group.log_path.read_text()
        assert f"{name.split('@')[0]} exited with status" in log and "restarting in 1 s" in log
    finally:
        group.stop()


def test_soft_time_limit_fails_the_request_and_the_replica_serves_on(redis_server, tmp_path):
    """Past REPLICADP_SOFT_TIME_LIMIT a request fails cleanly (FAILURE, SoftTimeLimitExceeded, not retried), and
    the same replica then serves the next request."""
    from conftest import run_client_on, start_replicas

    url = redis_server.url[:-1] + "4"
    group = start_replicas(1, url, "time-limits", OUTPUT_DIR=str(tmp_path), REPLICADP_SOFT_TIME_LIMIT="1",
                           REPLICADP_TIME_LIMIT="30")
    long = {"prompt": "too long", "height": 256, "width": 256, "num_frames": 33, "num_inference_steps": 30}
    try:
        first, second = run_client_on(url, [long, SHORT], concurrency=1)
    finally:
        group.stop()
    assert not first.ok and first.error.startswith("SoftTimeLimitExceeded"), first.error or first.result["timings"]
    assert second.ok and second.result["replica"] == group.names[0]


def test_hard_time_limit_replaces_the_process(redis_server, tmp_path):
    """Past REPLICADP_TIME_LIMIT the pool child is killed: the request fails with TimeLimitExceeded (not
    requeued: it would only time out again), a new child loads the model, and the replica serves on."""
    from conftest import run_client_on, start_replicas

    url = redis_server.url[:-1] + "4"
    group = start_replicas(1, url, "hard-limit", OUTPUT_DIR=str(tmp_path), REPLICADP_SOFT_TIME_LIMIT="0",
                           REPLICADP_TIME_LIMIT="2")
    long = {"prompt": "hangs", "height": 256, "width": 256, "num_frames": 33, "num_inference_steps": 30}
    try:
        child = json.loads(redis.Redis.from_url(url).get(REPLICA_KEY + group.names[0]))["pid"]
        first, second = run_client_on(url, [long, SHORT], concurrency=1)
    finally:
        group.stop()
    assert not first.ok and first.error.startswith("TimeLimitExceeded"), first.error or first.result["timings"]
    assert second.ok and second.result["replica"] == group.names[0]
    assert second.result["execution"].split(":")[1] != str(child)  # computed by the replacement child


def test_out_of_memory_fails_the_request_and_the_replica_serves_on(redis_server, tmp_path):
    """A request that needs more memory than the replica has (here: the pool child's address space is capped,
    the CPU stand-in for a CUDA OOM) fails with OutOfMemory naming its size; the memory is given back and the
    same process serves the next request."""
    import resource

    from conftest import run_client_on, start_replicas

    url = redis_server.url[:-1] + "5"
    group = start_replicas(1, url, "oom", OUTPUT_DIR=str(tmp_path), REPLICADP_MAX_WORK=str(10**12))
    try:
        child = json.loads(redis.Redis.from_url(url).get(REPLICA_KEY + group.names[0]))["pid"]
        size = vm_kib(child, "VmSize")
        cap = (size + 1024 * 1024) * 1024  # 1 GiB more address space than it has now
        resource.prlimit(child, resource.RLIMIT_AS, (cap, cap))
        rss = vm_kib(child, "VmRSS")
        huge = {"prompt": "too big", "height": 1024, "width": 1024, "num_frames": 81, "num_inference_steps": 2}
        first, second = run_client_on(url, [huge, SHORT], concurrency=1)
        rss_after = vm_kib(child, "VmRSS")
    finally:
        group.stop()
    assert not first.ok and first.error.startswith("OutOfMemory: height=1024 width=1024 num_frames=81"), \
        first.error or first.result["timings"]
    assert second.ok and second.result["execution"].split(":")[1] == str(child)  # the same process
    print(f"\nRSS {rss // 1024} MiB before the request, {rss_after // 1024} MiB after it failed and another ran")
    assert rss_after < rss + 300 * 1024


def vm_kib(pid: int, field: str) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def test_long_request_outlives_many_leases_and_runs_once(redis_server, tmp_path):
    """A request that runs for several leases (REPLICADP_LEASE=2 here, the request ~10 s) beside an idle replica
    whose sweep runs every second: the running replica's heartbeat keeps it, so it is started once and computed
    once, never on two replicas at once."""
    from conftest import run_client_on, start_replicas

    url = redis_server.url[:-1] + "6"
    group = start_replicas(2, url, "short-lease", OUTPUT_DIR=str(tmp_path), REPLICADP_LEASE="2")
    long = {"prompt": "outlive the lease", "height": 256, "width": 256, "num_frames": 33, "num_inference_steps": 150}
    try:
        (outcome,) = run_client_on(url, [long], concurrency=1)
        client = redis.Redis.from_url(url)
        starts = int(client.get(ATTEMPTS_KEY + outcome.task_id))
        duplicates = client.hget(STATS_KEY, "duplicate_executions")
    finally:
        group.stop()
    assert outcome.ok, outcome.error
    print(f"\nran {outcome.result['timings']['total_s']:.1f} s under a 2 s lease")
    assert outcome.result["timings"]["total_s"] > 3 * 2
    assert starts == 1 and duplicates is None and not outcome.result["redelivered"]
    assert "requeueing" not in group.log_path.read_text()


def test_redis_killed_and_restarted_loses_nothing(tmp_path):
    """SIGKILL of the Redis server (append-only file on) while requests are queued and running, restarted on
    the same port 2 s later: the replicas and the client reconnect by themselves and every request completes."""
    import threading

    from client.embedded import EmbeddedServer
    from conftest import run_client_on, start_replicas

    server = EmbeddedServer(tmp_path / "redis")
    url = server.start()
    group = start_replicas(2, url, "redis-restart", OUTPUT_DIR=str(tmp_path / "out"))
    requests = [{"prompt": f"through a restart {i}", "seed": i, **SLOW} for i in range(6)]
    outcomes = []
    try:
        client_run = threading.Thread(target=lambda: outcomes.extend(run_client_on(url, requests, concurrency=0)))
        client_run.start()
        client = redis.Redis.from_url(url)
        deadline = time.monotonic() + 60
        while not any(json.loads(client.get(k) or "{}").get("status") == "PROGRESS"
                      for k in client.keys("celery-task-meta-*")):
            assert time.monotonic() < deadline, "no request started"
            time.sleep(0.05)
        server = restart_redis(server, tmp_path / "redis", down_s=2)
        client_run.join(timeout=180)
        assert not client_run.is_alive(), "the client did not finish"
        starts = [int(client.get(ATTEMPTS_KEY + o.task_id) or 0) for o in outcomes]
        duplicates = int(client.hget(STATS_KEY, "duplicate_executions") or 0)
    finally:
        group.stop()
        server.stop()
    assert [o.ok for o in outcomes] == [True] * 6, [o.error for o in outcomes]
    assert sorted(o.result["params"]["seed"] for o in outcomes) == list(range(6))
    print(f"\nstarts per request: {starts}; computed twice: {duplicates}")
    assert duplicates == 0


def children_of(pid: int) -> set[int]:
    return {int(p.name) for p in Path("/proc").glob("[0-9]*") if p.name != str(pid) and _parent_or_none(int(p.name)) == pid}


def _parent_or_none(pid: int) -> int | None:
    try:
        return parent_of(pid)
    except (OSError, IndexError):  # gone meanwhile
        return None


def test_replacement_child_rides_out_a_redis_restart_before_its_replica_consumes(tmp_path):
    """The only replica's pool child killed mid-request; its replacement loads the model, then asks its main
    process to reopen the shared queue, and Redis restarts while it is asking (made certain here by stopping the
    main process, so that the question is still open when Redis dies). The child keeps asking: once Redis is
    back, the replica consumes again, and the interrupted request and a new one complete on it. (Seen in a
    chaos run before this was handled: the child's error was logged and dropped, and its replica stayed idle
    beside a loaded model for good.)"""
    import threading

    from client.embedded import EmbeddedServer
    from conftest import run_client_on, start_replicas

    server = EmbeddedServer(tmp_path / "redis")
    url = server.start()
    group = start_replicas(1, url, "reload-restart", OUTPUT_DIR=str(tmp_path / "out"))
    first, main = [], None
    try:
        client_run = threading.Thread(target=lambda: first.extend(
            run_client_on(url, [{"prompt": "through a reload", "seed": 5, **SLOW}], concurrency=0, timeout=180)))
        client_run.start()
        client = redis.Redis.from_url(url)
        deadline = time.monotonic() + 60
        while not (running := [json.loads(client.get(k))["result"] for k in client.keys("celery-task-meta-*")
                               if json.loads(client.get(k) or "{}").get("status") == "PROGRESS"]):
            assert time.monotonic() < deadline, "the request did not start"
            time.sleep(0.05)
        killed = running[0]["pid"]
        main = parent_of(killed)
        os.kill(killed, signal.SIGKILL)
        while not (children_of(main) - {killed}):  # the replacement child is forked
            assert time.monotonic() < deadline, "no replacement child"
            time.sleep(0.05)
        os.kill(main, signal.SIGSTOP)
        replacement = (children_of(main) - {killed}).pop()
        while json.loads(client.get(REPLICA_KEY + group.names[0]))["pid"] != replacement:  # loaded; now asking
            assert time.monotonic() < deadline + 60, "the replacement child did not load"
            time.sleep(0.05)
        server = restart_redis(server, tmp_path / "redis", down_s=3)
        os.kill(main, signal.SIGCONT)
        client_run.join(timeout=240)
        assert not client_run.is_alive(), "the client did not finish"
        after = run_client_on(url, [SHORT], concurrency=0)
    finally:
        if main is not None:
            os.kill(main, signal.SIGCONT)
        group.stop()
        server.stop()
    assert [o.ok for o in first + after] == [True, True], [o.error for o in first + after]
    assert {o.result["replica"] for o in first + after} == {group.names[0]}
