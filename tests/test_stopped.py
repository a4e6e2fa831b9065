"""Exactly once for a stopped (frozen, partitioned) replica: a replica's main process, its pool child, or both,
stopped with SIGSTOP mid-request for longer than a lease and resumed with SIGCONT, never make a request run to
the end twice. Synthetic replicas, so that a request lasts the time the test sets on any machine, with a lease
of 2 s, so that a stop of a few leases takes seconds."""

import os
import signal
import time
from types import SimpleNamespace

import pytest
import redis
from celery import states

from client.api import _app_for
from conftest import start_replicas
from helpers import SYNTHETIC, lasting, parent_of, wait_for, wait_for_reload, wait_for_step
from replicadp_tasks.contract.keys import FENCE_KEY, FenceToken, HOLDERS_KEY, STATS_KEY
from replicadp_tasks.contract import RequestState

LEASE_S = 2


@pytest.fixture(scope="module")
def group(redis_db):
    url = redis_db()
    replicas = start_replicas(2, url, "stopped", model=SYNTHETIC, REPLICADP_LEASE=str(LEASE_S))
    yield SimpleNamespace(url=url, names=replicas.names, serving=replicas.serving, app=_app_for(url),
                          redis=redis.Redis.from_url(url))
    replicas.stop()


def duplicates(group) -> int:
    return int(group.redis.hget(STATS_KEY, "duplicate_executions") or 0)


def stopped(*pids):
    """SIGSTOP `pids` now; the returned function resumes them (call it in a finally: never leave one stopped)."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)

    def resume():
        for pid in pids:
            os.kill(pid, signal.SIGCONT)

    return resume


def held_by_other(group, stopped_replica: str):
    """True once the other replica has recorded that it holds a delivery (the requeued copy)."""
    holders = {h.decode() for h in group.redis.hvals(HOLDERS_KEY)}
    return holders - {stopped_replica}


def reloaded(group, replica: str, old_child: int) -> None:
    """Wait until `replica` has loaded its model in a new pool child and consumes its model's queue again."""
    wait_for_reload(group.redis, replica, old_child)
    wait_for(lambda: replica in group.serving(), f"{replica} to consume its model's queue")


def serves_both(group) -> None:
    """Both replicas take a request again (two at once, each lasting a second)."""
    canaries = [group.app.send_task("replicadp.generate", kwargs=lasting(1.0, seed=s)) for s in range(2)]
    assert {c.get(timeout=60)["replica"] for c in canaries} == set(group.names)


def test_stopped_main_process_the_copy_waits_for_the_childs_result(group):
    """The main process stopped past its lease: its message is requeued and the other replica takes the copy,
    but the pool child, still computing, keeps the fence; the copy waits and returns the child's result. One
    execution; no duplicate counted; both replicas serve afterwards."""
    before = duplicates(group)
    result = group.app.send_task("replicadp.generate", kwargs=lasting(6.0, request_id="main-stopped"))
    info = wait_for_step(group, result.id, 2)
    resume = stopped(parent_of(info["pid"]))
    try:
        wait_for(lambda: held_by_other(group, info["replica"]), "the other replica to take the requeued copy",
                 timeout=10 * LEASE_S)
        value = result.get(timeout=60)
    finally:
        resume()
    assert value["replica"] == info["replica"] and FenceToken.parse(value["execution"]) == FenceToken(info["replica"], info["pid"], result.id)
    assert duplicates(group) == before
    serves_both(group)
    assert duplicates(group) == before


@pytest.mark.parametrize("order", ["main first", "child first"])
def test_stopped_replica_resumes_after_the_copy_finished_and_stores_nothing(group, order):
    """Main process and pool child both stopped past their lease (a frozen host): the fence lapses, the copy on
    the other replica takes it and computes the request to the end. Resumed, the stopped child finds at its next
    check that the request is another's and exits without storing; its main process requeues the message, whose
    next delivery returns the stored result. The result is the other replica's, no duplicate is counted, and the
    stopped replica reloads and serves again."""
    before = duplicates(group)
    result = group.app.send_task("replicadp.generate", kwargs=lasting(4.0, request_id=f"both-stopped-{order.split()[0]}"))
    info = wait_for_step(group, result.id, 2)
    child, main = info["pid"], parent_of(info["pid"])
    resume = stopped(*((main, child) if order == "main first" else (child, main)))
    try:
        value = result.get(timeout=60)
        assert value["replica"] != info["replica"]
    finally:
        resume()
    assert wait_for(lambda: group.redis.get(FENCE_KEY + f"both-stopped-{order.split()[0]}") is None, "the fence released")
    assert duplicates(group) == before
    reloaded(group, info["replica"], child)
    serves_both(group)
    assert duplicates(group) == before
    assert group.app.backend.get_task_meta(result.id)["status"] == states.SUCCESS


def test_stopped_child_keeps_its_request(group):
    """The pool child alone stopped for several leases: its main process keeps the heartbeat and the fence, so
    nothing is requeued; resumed, the child finishes the request, once, on its replica."""
    before = duplicates(group)
    result = group.app.send_task("replicadp.generate", kwargs=lasting(3.0, request_id="child-stopped"))
    info = wait_for_step(group, result.id, 2)
    resume = stopped(info["pid"])
    try:
        time.sleep(4 * LEASE_S)  # the fault's length, not a wait for compute
        assert not held_by_other(group, info["replica"])
        assert group.app.backend.get_task_meta(result.id)["status"] == RequestState.PROGRESS
    finally:
        resume()
    value = result.get(timeout=60)
    assert value["replica"] == info["replica"] and not value["redelivered"]
    assert duplicates(group) == before
