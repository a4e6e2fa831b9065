"""Process deaths with real replicas: a killed pool child's request is requeued and completes; a request that
kills its process every time is failed as poison after REPLICADP_MAX_ATTEMPTS starts."""

import json
import os
import signal
import time

import pytest
import redis

from replicadp_tasks import app, generate
from replicadp_tasks.errors import PoisonRequest
from replicadp_tasks.worker import DEAD_KEY

SLOW = {"height": 128, "width": 128, "num_frames": 17, "num_inference_steps": 30}  # ~1-2 s on the tiny model


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


def serve_again(replicas):
    """Both replicas serve again (a killed child is replaced and reloads its model)."""
    results = [generate.delay(prompt="after", seed=s, height=64, width=64, num_frames=5, num_inference_steps=2)
               for s in range(4)]
    assert all(r.get(timeout=120)["replica"] in replicas.names for r in results)


def test_killed_pool_child_requeues_its_request(replicas):
    """SIGKILL of the pool child mid-request (an OOM kill): the request goes back to the queue, completes on a
    replica, and the caller's get() returns the success, not WorkerLostError."""
    result = generate.delay(prompt="survive a kill", seed=9, **SLOW)
    pid = running_pid(result.id)
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    meta = result.get(timeout=120)
    assert meta["params"]["seed"] == 9 and len(meta["frames_sha256"]) == 64
    print(f"\nrequeued and completed {time.monotonic() - killed:.1f} s after the kill")
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
        main = int(open(f"/proc/{child}/stat").read().rsplit(")", 1)[1].split()[1])  # the child's parent
        os.kill(main, signal.SIGKILL)
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
    short = {"prompt": "short", "height": 64, "width": 64, "num_frames": 5, "num_inference_steps": 2}
    try:
        first, second = run_client_on(url, [long, short], concurrency=1)
    finally:
        group.stop()
    assert not first.ok and first.error.startswith("SoftTimeLimitExceeded"), first.error or first.result["timings"]
    assert second.ok and second.result["replica"] == group.names[0]
