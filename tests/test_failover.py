"""A Redis that fails over (client/local/ha.py: a primary, two replicas, three Sentinels) under a batch of 40
requests on two synthetic-backend replicas, half sent through a gateway and half by a Celery producer: the
primary SIGKILLed, the primary SIGSTOPped until Sentinel promotes another and then resumed, the primary frozen
(SIGSTOP) for longer than the failover, and a Sentinel SIGKILLed, each mid-batch (requests queued, running and
finishing). Nothing is lost, nothing is computed twice, and the replicas and the gateway serve on through the new
primary."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import redis

from client.local.ha import HAStack
from conftest import start_replicas
from client.api import _app_for
from helpers import SYNTHETIC, lasting, wait_for, wait_for_step
from replicadp_tasks.cluster import connection
from replicadp_tasks.cluster import preempt
from replicadp_tasks.contract.keys import ATTEMPTS_KEY, CHECKPOINT_KEY, PREEMPTIONS_KEY, STATS_KEY
from replicadp_tasks.contract import queue_for, queue_lists
from replicadp_tasks.settings import SETTINGS
from replicadp_tasks.cluster import outage_tolerant
from test_http import form_of, gateway, multipart

BATCH = 40  # half through the gateway, half through Celery
REQUEST_S = 0.4  # each, on the synthetic backend: the batch lasts ~8 s on two replicas
FLOWING = 8  # results after a fault that say the batch flows again: more than the replicas hold at once


@pytest.fixture
def ha(tmp_path):
    stack = HAStack(tmp_path / "ha")
    stack.start()
    yield stack
    stack.stop()


# A Celery producer that sends its whole batch, says so, and prints the outcomes once all have ended.
SEND_ALL = """
import json, sys
from client.api import run_requests
batch = json.loads(sys.argv[1])
said = False

def on_update(in_flight, finished):
    global said
    if not said and len(in_flight) == len(batch):
        said = True
        print("sent", flush=True)

print(json.dumps([o.__dict__ for o in run_requests(batch, concurrency=0, timeout=240, on_update=on_update)]))
"""


def stored(out) -> int:
    """Results in the replicas' output folder (the dir store writes <id>.json last)."""
    return len(list(out.glob("*.json"))) if out.exists() else 0


def whereabouts(url: str, logs: list, job_id: str) -> str:
    """Where a request is, for the message of a failed test: the Redis keys that name it or hold it, and the lines
    of the replicas' and the gateway's logs that name it."""
    r = connection.client(url, socket_timeout=5)
    found, mark = [], job_id.encode()
    for key in r.scan_iter(count=1000):
        kind = r.type(key).decode()
        values = {"list": lambda: r.lrange(key, 0, -1), "hash": lambda: [k + v for k, v in r.hgetall(key).items()],
                  "zset": lambda: r.zrange(key, 0, -1), "string": lambda: [r.get(key) or b""]}.get(kind, list)()
        if mark in key or any(mark in v for v in values):
            found.append(f"{key.decode()} ({kind})")
    lines = [line for path in logs if path.exists() for line in path.read_text(errors="replace").splitlines()
             if job_id in line and "GET /v1/videos/" not in line]
    return f"{job_id}: in {found}; logged: {lines[-12:]}"


def through_a_fault(ha: HAStack, tmp_path, name: str, fault) -> SimpleNamespace:
    """Send the batch, run `fault(ha)` once some requests are stored and others still wait, and wait for the
    batch to end. What it counts: requests not completed, stored results computed by a second delivery, starts
    per request, and seconds from the fault to the first result stored after it and to the FLOWING-th (each
    process that waits on the old primary stalls the flow on its own)."""
    out = tmp_path / "out"
    group = start_replicas(2, ha.url, name, model=SYNTHETIC, OUTPUT_DIR=str(out))
    celery_batch = [lasting(REQUEST_S, prompt=f"{name} celery {i}", seed=i) for i in range(BATCH // 2)]
    http_batch = [form_of(lasting(REQUEST_S, prompt=f"{name} http {i}", seed=100 + i)) for i in range(BATCH // 2)]
    producer = None
    try:
        with gateway(ha.url, name) as gw:
            jobs = [gw.client.post("/v1/videos", files=multipart(form)) for form in http_batch]
            assert [j.status_code for j in jobs] == [200] * len(jobs), [j.text for j in jobs]
            producer = subprocess.Popen([sys.executable, "-c", SEND_ALL, json.dumps(celery_batch)],
                                        stdout=subprocess.PIPE, text=True, env={**os.environ, "REDIS_URL": ha.url})
            assert producer.stdout.readline() == "sent\n", "the Celery producer did not send its batch"
            wait_for(lambda: stored(out) >= 4, "a few requests to be stored", interval=0.02)
            before, struck = stored(out), time.monotonic()
            fault(ha)
            wait_for(lambda: stored(out) > before, "a result stored after the fault", interval=0.02, timeout=120)
            resumed_s = time.monotonic() - struck
            wait_for(lambda: stored(out) >= before + FLOWING, f"{FLOWING} results stored after the fault",
                     interval=0.02, timeout=120)
            flowing_s = time.monotonic() - struck

            ids = [j.json()["id"] for j in jobs]
            unended = {}  # id: the last answer that was not an end, for the message of a timeout

            def ended() -> bool:
                for job_id in ids:
                    answer = gw.client.get(f"/v1/videos/{job_id}")  # a 503 while Redis fails over: asked again
                    if answer.status_code == 200 and answer.json()["status"] in ("completed", "failed"):
                        unended.pop(job_id, None)
                    else:
                        unended[job_id] = f"{answer.status_code} {answer.text[:200]}"
                return not unended

            try:
                wait_for(ended, "the gateway's jobs to end", timeout=240)
            except TimeoutError as exc:
                where = [whereabouts(ha.url, [group.log_path, gw.log_path], i) for i in unended]
                raise AssertionError(f"{len(unended)} job(s) not ended, the last answers: {unended}; {where}") from exc
            http = [gw.client.get(f"/v1/videos/{i}").json() for i in ids]
            outcomes = [SimpleNamespace(**o) for o in json.loads(producer.communicate(timeout=300)[0])]
            assert producer.returncode == 0
            # The gateway serves on through the new primary: one more request, start to end.
            after = gw.client.post("/v1/videos/sync", files=multipart(form_of(lasting(REQUEST_S, seed=999))))
        check = connection.client(ha.url, socket_timeout=5)
        starts = [int(check.get(ATTEMPTS_KEY + o.task_id) or 0) for o in outcomes]
        twice = int(check.hget(STATS_KEY, "duplicate_executions") or 0)
    finally:
        if producer is not None:
            producer.kill()
            producer.wait()
        group.stop()
    failed = [o.error for o in outcomes if not o.ok] + [j.get("error") for j in http if j["status"] != "completed"]
    print(f"\n{name}: failed {failed}; computed twice {twice}; starts {starts}; first result {resumed_s:.2f} s after "
          f"the fault, {FLOWING} results {flowing_s:.2f} s after it")
    return SimpleNamespace(failed=failed, twice=twice, starts=starts, resumed_s=resumed_s, flowing_s=flowing_s,
                           after=after,
                           seeds=sorted(o.result["params"]["seed"] for o in outcomes if o.ok))


def assert_nothing_lost(run):
    assert run.failed == [], run.failed
    assert run.seeds == list(range(BATCH // 2))
    assert run.twice == 0
    assert run.after.status_code == 200 and run.after.content[4:8] == b"ftyp"


@pytest.mark.cluster
def test_primary_killed_mid_batch_loses_nothing(ha, tmp_path):
    """SIGKILL of the primary (it stays down): Sentinel promotes a replica, the replicas, the producer and the
    gateway reconnect through it; every request of the batch completes once."""
    old = ha.primary()
    run = through_a_fault(ha, tmp_path, "failover-kill", lambda ha: os.kill(ha.server_pid(old), signal.SIGKILL))
    assert ha.primary() is not old
    assert_nothing_lost(run)


@pytest.mark.cluster
def test_primary_stopped_until_promotion_takes_no_writes_when_resumed(ha, tmp_path):
    """SIGSTOP of the primary until Sentinel promotes another, then SIGCONT: within seconds the resumed old
    primary refuses writes (NOREPLICAS: its replicas follow the new one; READONLY once Sentinel demotes it)
    instead of acting as a second primary (in the second after it resumes it may still take one, which no replica
    acknowledges: test_a_request_sent_to_a_stopped_primary_is_queued_on_the_new_one), and the batch completes once
    through the new one."""
    old = ha.primary()
    pid = ha.server_pid(old)
    refused = []

    def refuses_writes() -> bool:
        try:
            redis.Redis(port=old.port, password=ha.password, socket_timeout=5).set("replicadp:split-brain", 1)
        except redis.ResponseError as exc:  # ReadOnlyError is one
            refused.append(exc)
        except redis.ConnectionError:  # Sentinel closes its clients as it demotes it: ask again
            pass
        return bool(refused)

    def stop_until_promoted(ha):
        os.kill(pid, signal.SIGSTOP)
        try:
            wait_for(lambda: ha.master_address()[1] != old.port, "Sentinel to promote a replica", timeout=30)
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_for(refuses_writes, "the resumed old primary to refuse writes", timeout=15, interval=0.1)

    run = through_a_fault(ha, tmp_path, "failover-stop", stop_until_promoted)
    assert isinstance(refused[0], redis.ReadOnlyError) or str(refused[0]).startswith("NOREPLICAS"), refused
    assert_nothing_lost(run)


FREEZE_S = 30  # longer than Sentinel's failover (~5 s: client/local/ha.py)
# What leaving a frozen primary may take past its promotion, for FLOWING results: a command sent to it just before,
# waiting out REPLY_TIMEOUT_S (5 s), the new primary's first replica, and the retries (measured: 4.7-8.0 s). Each
# connection learning it alone took 16.5 s; waiting for the thaw, FREEZE_S + ~10 s.
LEAVE_SLACK_S = 12


@pytest.mark.cluster
def test_a_frozen_primary_is_left_for_the_promoted_one_while_it_stays_frozen(ha, tmp_path):
    """SIGSTOP of the primary for FREEZE_S, past Sentinel's promotion (a paused VM, a partition: its connections
    stay open and answer nothing): replicas, the Celery producer and the gateway leave it within seconds of the
    promotion, results are stored while it is still frozen, and the batch completes once."""
    old = ha.primary()
    pid = ha.server_pid(old)
    thaw = threading.Timer(FREEZE_S, os.kill, (pid, signal.SIGCONT))
    promoted = {}

    def freeze(ha):
        os.kill(pid, signal.SIGSTOP)
        thaw.start()
        struck = time.monotonic()
        wait_for(lambda: ha.master_address()[1] != old.port, "Sentinel to promote a replica", timeout=FREEZE_S)
        promoted["s"] = time.monotonic() - struck

    try:
        run = through_a_fault(ha, tmp_path, "failover-freeze", freeze)
    finally:
        thaw.cancel()
        os.kill(pid, signal.SIGCONT)
    print(f"promoted {promoted['s']:.1f} s after the freeze, {FLOWING} results {run.flowing_s:.1f} s after it")
    assert run.flowing_s < promoted["s"] + LEAVE_SLACK_S < FREEZE_S, (run.flowing_s, promoted)
    assert_nothing_lost(run)


@pytest.mark.cluster
def test_a_sentinel_killed_mid_batch_changes_nothing(ha, tmp_path):
    """SIGKILL of the first Sentinel (the one every client asks first): clients ask the next one, the primary
    stays, and the batch completes once."""
    primary = ha.primary()
    run = through_a_fault(ha, tmp_path, "failover-sentinel",
                          lambda ha: os.kill(ha.server_pid(ha.sentinels[0]), signal.SIGKILL))
    assert ha.primary() is primary
    assert_nothing_lost(run)


@pytest.mark.cluster
def test_a_preempted_request_goes_on_from_its_checkpoint_on_the_promoted_primary(ha, tmp_path):
    """One synthetic replica runs a batch request; an interactive one waits, and the batch one is preempted at a
    step. Once its checkpoint is in Redis (written, as a fence is, only once a Redis replica holds it:
    REPLICADP_REDIS_REPLICAS is 1 with Sentinel), the primary is SIGKILLed: through the promoted one the
    interactive request completes, then the batch request goes on from its saved step and completes once,
    preempted once, its checkpoint gone with its completion."""
    old = ha.primary()
    group = start_replicas(1, ha.url, "failover-preempt", model=SYNTHETIC, OUTPUT_DIR=str(tmp_path / "out"))
    on = SimpleNamespace(app=_app_for(ha.url))
    try:
        batch = on.app.send_task("replicadp.generate", kwargs=lasting(6, prompt="through a failover", seed=1,
                                                                      priority="batch"))
        info = wait_for_step(on, batch.id, 2)
        interactive = on.app.send_task("replicadp.generate", kwargs=lasting(1, prompt="first", seed=2,
                                                                            priority="interactive"))
        client = connection.client(ha.url, socket_timeout=5)
        preempt.ask(client, batch.id)
        saved = int(wait_for(lambda: client.hget(CHECKPOINT_KEY + info["request_id"], "step"), "a checkpoint"))
        os.kill(ha.server_pid(old), signal.SIGKILL)
        first, done = interactive.get(timeout=120), batch.get(timeout=120)
        client = connection.client(ha.url, socket_timeout=5)
        counts = (client.get(PREEMPTIONS_KEY + batch.id), client.hget(STATS_KEY, "duplicate_executions"),
                  client.exists(CHECKPOINT_KEY + info["request_id"]))
    finally:
        group.stop()
    assert ha.primary() is not old
    assert first["params"]["seed"] == 2 and done["params"]["seed"] == 1
    assert counts == (b"1", None, 0), counts
    assert f"request {info['request_id']} goes on from step {saved} of " in group.log_path.read_text()


def written_through_a_stop(ha: HAStack, script: str) -> list[str]:
    """Run `script` in a process of its own on the HA stack: it writes, prints a line, waits for a line on stdin,
    writes again and prints a line. Its second write is sent while the primary is stopped, which resumes once
    Sentinel has promoted a replica. Its two lines."""
    old = ha.primary()
    pid = ha.server_pid(old)
    writer = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "REDIS_URL": ha.url, "REPLICADP_MODELS": "tiny"})
    try:
        first = writer.stdout.readline().strip()
        os.kill(pid, signal.SIGSTOP)
        try:
            writer.stdin.write("go\n")
            writer.stdin.flush()
            wait_for(lambda: ha.master_address()[1] != old.port, "Sentinel to promote a replica", timeout=30)
        finally:
            os.kill(pid, signal.SIGCONT)
        second = writer.stdout.readline().strip()
        assert writer.wait(timeout=60) == 0
    finally:
        writer.kill()
    return [first, second]


PRODUCER = """
import sys
from replicadp_tasks import generate
print(generate.apply_async(kwargs={"prompt": "before the stop"}).id, flush=True)
sys.stdin.readline()
print(generate.apply_async(kwargs={"prompt": "during the stop"}).id, flush=True)
"""


def test_a_request_sent_to_a_stopped_primary_is_queued_on_the_new_one(ha):
    """A producer connected to the primary sends a request while the primary is stopped; Sentinel promotes a
    replica and the old primary resumes. The old primary may take the write (it still counts its replicas for up
    to a second after it resumes) but no replica acknowledges it, so the producer puts it again through the new
    primary before `apply_async` returns: both requests are queued there (had been: the second was lost with
    the old primary's data when it rejoined as a replica, its producer told it was queued)."""
    first, second = written_through_a_stop(ha, PRODUCER)
    assert first and second
    client = outage_tolerant(ha.url, 30)  # the new primary refuses connections until a replica follows it
    queued = b"".join(m for key in queue_lists(queue_for(SETTINGS.queue, "tiny")) for m in client.lrange(key, 0, -1))
    assert first.encode() in queued and second.encode() in queued


ANSWERER = """
import sys
from replicadp_tasks.app import app
app.backend.mark_as_done("answered-before-the-stop", {"n": 1})
print("answered", flush=True)
sys.stdin.readline()
app.backend.mark_as_done("answered-during-the-stop", {"n": 2})
print("answered", flush=True)
"""


def test_an_answer_written_to_a_stopped_primary_is_kept_on_the_new_one(ha):
    """A request's answer (its SUCCESS state, as a replica's finisher writes it) written while the primary is
    stopped, which resumes once Sentinel promotes a replica: the old primary may take it, unacknowledged, in the
    second after it resumes; the writer makes it again through the new primary before it returns (had been: lost,
    while the message's acknowledgement, on another connection, reached the new primary; the job stayed
    `in_progress` for ever)."""
    assert written_through_a_stop(ha, ANSWERER) == ["answered", "answered"]
    client = outage_tolerant(ha.url, 30)
    for task_id in ("answered-before-the-stop", "answered-during-the-stop"):
        meta = client.get(f"celery-task-meta-{task_id}")
        assert meta is not None and json.loads(meta)["status"] == "SUCCESS", (task_id, meta)
