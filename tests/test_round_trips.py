"""What a request asks of Redis (issue #38, docs/benchmarks.md section 15): a denoising step asks nothing while all
is well (the fence keeper's last look answers it), a cancel reaches the fence keeper at once, each record of a
request is one round trip that never replaces a success, the holder of a message is recorded in the
transaction that records its delivery, and the fence is released in the round trip that records the completion.
Read from what the server itself sees (MONITOR), on real replicas."""

import os
import threading
import uuid
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import redis
from celery import Celery
from conftest import run_client_on, start_replicas
from helpers import wait_for

from client.api import _app_for
from replicadp_tasks.cluster.connection import celery_backend_url
from replicadp_tasks.cluster.fence import RENEW, acquire
from replicadp_tasks.contract import RequestState
from replicadp_tasks.contract.keys import CANCEL_CHANNEL, CANCEL_KEY, FENCE_KEY, HOLDERS_KEY, FenceToken
from replicadp_tasks.replica import FenceKeeper

RENEWAL = RENEW.splitlines()[0]  # as MONITOR shows the script: its first line, which only the renewal has

INSTANT = {"prompt": "instant", "height": 64, "width": 64, "num_frames": 5}


@pytest.fixture(scope="module")
def instant(redis_db):
    """One replica of `synthetic:0` (nothing to compute: a request is its serving cost alone), on a database of
    its own."""
    url = redis_db()
    group = start_replicas(1, url, "round-trips", model="synthetic:0")
    yield SimpleNamespace(url=url, app=_app_for(url), redis=redis.Redis.from_url(url))
    group.stop()


@contextmanager
def monitored(url: str):
    """Every command the server runs meanwhile (MONITOR), as (client address, command), scripts' own calls left
    out. It ends at a marker command sent last, so that every command before it is read, however far behind the
    reading thread is."""
    seen, ready, marker = [], threading.Event(), f"end-of-monitor-{uuid.uuid4()}"
    client = redis.Redis.from_url(url)

    def watch():
        with client.monitor() as monitor:
            ready.set()
            while True:
                command = monitor.next_command()
                if marker in command["command"]:
                    return
                if command.get("client_type") != "lua":
                    seen.append((f"{command['client_address']}:{command['client_port']}", command["command"]))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    ready.wait(10)
    try:
        yield seen
    finally:
        client.execute_command("ECHO", marker)
        watcher.join(30)
        assert not watcher.is_alive(), "the monitor never saw its end marker"


def naming(seen, *names) -> list[str]:
    return [command for _, command in seen if any(name in command for name in names)]


@pytest.mark.cluster
def test_a_denoising_step_asks_redis_nothing(instant):
    """A request of 41 steps sends no more commands about its fence or its cancel than one of 1 step (the fence
    keeper's ticks aside, a few at most): every step reads the fence keeper's last look. Each step used to be an
    EXISTS and an EVAL, fsynced: 80 more commands."""
    counts = {}
    for steps in (1, 41):
        with monitored(instant.url) as seen:
            [outcome] = run_client_on(instant.url, [{**INSTANT, "num_inference_steps": steps}], concurrency=1)
        assert outcome.ok, outcome.error
        task_id, request_id = outcome.task_id, outcome.result["request_id"]
        counts[steps] = naming(seen, CANCEL_KEY + task_id, FENCE_KEY + request_id)
        assert counts[steps], "the replica asked nothing about this request's fence and cancel"
    assert len(counts[41]) - len(counts[1]) <= 6, counts


@pytest.mark.cluster
def test_the_holder_is_recorded_in_the_transaction_that_records_the_delivery(instant):
    """As the replica's main process takes a message off the queue, kombu's record of the delivery (`unacked`)
    and replicadp's of its holder (`replicadp:holders`) are one MULTI/EXEC: no round trip of their own before the
    request reaches the pool child, and no moment when one is written without the other."""
    with monitored(instant.url) as seen:
        [outcome] = run_client_on(instant.url, [{**INSTANT, "num_inference_steps": 1}], concurrency=1)
    assert outcome.ok, outcome.error
    at = next(i for i, (_, command) in enumerate(seen)
              if command.startswith("HSET unacked ") and outcome.task_id in command)
    client, tag = seen[at][0], seen[at][1].split()[2]
    after = [command for who, command in seen[at + 1:] if who == client][:2]
    assert after[0].split()[:3] == ["HSET", HOLDERS_KEY, tag] and after[1] == "EXEC", after


@pytest.mark.cluster
def test_the_fence_is_released_by_the_script_that_records_the_completion(instant):
    """A stored request's fence is released in the round trip that records its completion (the script that
    releases it unless the request was cancelled meanwhile), not by a round trip of its own after it: after that
    script, no command names the fence but the main process's lease ticks (renewals until the pool child
    acknowledges the message, then a release: its connection is the one that renews), and the fence is gone. The
    pool child's fence keeper renews it no more either: it stops keeping the fence before the script."""
    with monitored(instant.url) as seen:
        [outcome] = run_client_on(instant.url, [{**INSTANT, "num_inference_steps": 1}], concurrency=1)
    assert outcome.ok, outcome.error
    fence, cancel = FENCE_KEY + outcome.result["request_id"], CANCEL_KEY + outcome.task_id
    named = [(client, command) for client, command in seen if fence in command]
    at = next(i for i, (_, command) in enumerate(named) if command.startswith("EVAL") and cancel in command)
    renewing = {client for client, command in named[at + 1:] if command.startswith("EVAL") and RENEWAL in command}
    assert len(renewing) <= 1, f"more than the main process's lease thread renewed the fence after: {named[at:]}"
    assert [command for client, command in named[at + 1:] if client not in renewing] == [], named[at:]
    assert not instant.redis.exists(fence)


def test_a_record_is_one_round_trip_and_never_replaces_a_success(redis_db):
    """The result backend (backend.py) writes a record with one command, where Celery's reads it first; and
    neither a PROGRESS nor a FAILURE written after a SUCCESS replaces it (a lost duplicate must not)."""
    url = redis_db()
    backend = Celery(broker=url, backend=celery_backend_url(url)).backend
    task_id = f"records-{uuid.uuid4()}"
    with monitored(url) as seen:
        backend.store_result(task_id, {"step": 1}, RequestState.PROGRESS)
        backend.store_result(task_id, {"step": 2}, RequestState.PROGRESS)
        backend.store_result(task_id, {"done": True}, RequestState.SUCCESS)
        backend.store_result(task_id, {"step": 3}, RequestState.PROGRESS)
        backend.store_result(task_id, ValueError("late"), RequestState.FAILURE)
    assert len(naming(seen, task_id)) == 5, naming(seen, task_id)
    meta = backend.get_task_meta(task_id)
    assert (meta["status"], meta["result"]) == (RequestState.SUCCESS, {"done": True})


def test_the_fence_keeper_hears_a_cancel_at_once_and_sees_a_lost_fence_at_its_tick(redis_db):
    """A step's answer (`FenceKeeper.clear`): all well once the fence is taken; not so once a cancel of its task
    is published, though no cancel key exists (so only the channel can have told it: its tick looks for the
    key); and for another delivery, once the fence is taken from under it (seen at the keeper's next tick)."""
    url = redis_db()
    client = redis.Redis.from_url(url)
    listening = client.pubsub_numsub(CANCEL_CHANNEL)[0][1]  # the channel is the server's: other replicas' too
    keeper = FenceKeeper(url, lease_s=6)
    threading.Thread(target=keeper.run, daemon=True).start()
    wait_for(lambda: client.pubsub_numsub(CANCEL_CHANNEL)[0][1] > listening, "the keeper to listen")
    for name in ("cancelled", "fenced out"):
        tok = FenceToken("test@host", os.getpid(), f"{name.replace(' ', '-')}-{uuid.uuid4()}")
        fence = FENCE_KEY + tok.task_id
        assert acquire(client, fence, tok, 6).ours
        keeper.watch(fence, tok)
        assert keeper.clear(tok)
        if name == "cancelled":
            client.publish(CANCEL_CHANNEL, tok.task_id)
            wait_for(lambda: not keeper.clear(tok), "the keeper to hear the cancel", interval=0.01)
            assert not client.exists(CANCEL_KEY + tok.task_id)
        else:
            client.set(fence, "another@host:1:other", px=6000)
            wait_for(lambda: not keeper.clear(tok), "the keeper to see the fence taken", interval=0.05)
        keeper.unwatch(tok)
