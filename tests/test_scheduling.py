"""Scheduling (replicadp_tasks/broker/placement.py, contract/scheduling.py): a replica takes the highest priority waiting, round robin across
tenants within a priority, then across users within a tenant, FIFO within a user; a requeued request goes back to
the head of its own priority.

The order tests queue every request before the replica that serves them starts, so the order it takes them in
is the queue's alone, on any machine: one replica runs one request at a time, and completes them in the order
it started them."""

import base64
import json
import os
import signal
import subprocess
import sys
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import redis

from client.api import _app_for
from conftest import start_replicas
from helpers import SYNTHETIC, declared, lasting, model_queue, queue_depth, wait_for_step
from replicadp_tasks.contract import InvalidRequest
from replicadp_tasks.contract.keys import ATTEMPTS_KEY
from replicadp_tasks.contract import Priority, queue_lists

SHORT = lasting(0.25)  # one step of the synthetic backend


def queued(client) -> list[list[str]]:
    """The prompts waiting in each priority's list, in the order a replica takes them."""
    def prompt(raw):
        return json.loads(base64.b64decode(json.loads(raw)["body"]))[1]["prompt"]

    return [[prompt(raw) for raw in reversed(client.lrange(key, 0, -1))] for key in queue_lists(model_queue(SYNTHETIC))]


def served_order(app, results) -> list[str]:
    """The prompts of `results` (all served by one replica) in the order it completed, so started, them."""
    done = {r.get(timeout=120)["params"]["prompt"]: app.AsyncResult(r.id).date_done for r in results}
    return sorted(done, key=done.get)


@contextmanager
def serving(url: str, name: str):
    """One synthetic-backend replica on `url` while the block runs."""
    group = start_replicas(1, url, name, model=SYNTHETIC)
    try:
        yield group
    finally:
        group.stop()


def send(app, prompt: str, **fields):
    return app.send_task("replicadp.generate", kwargs={**SHORT, "prompt": prompt, **fields})


def test_a_higher_priority_overtakes_a_backlog(redis_db):
    """With a backlog of batch and normal requests queued, an interactive request sent last is taken first, the
    normal ones next, the batch ones last, each priority in the order it was sent."""
    url = declared(redis_db(), SYNTHETIC)
    app = _app_for(url)
    results = [send(app, f"batch {i}", priority="batch") for i in range(4)]
    results += [send(app, f"normal {i}") for i in range(2)]
    results.append(send(app, "interactive", priority="interactive"))
    assert queued(redis.Redis.from_url(url)) == [["interactive"], ["normal 0", "normal 1"],
                                                 [f"batch {i}" for i in range(4)]]
    with serving(url, "priorities"):
        assert served_order(app, results) == ["interactive", "normal 0", "normal 1",
                                              "batch 0", "batch 1", "batch 2", "batch 3"]


def test_round_robin_across_users(redis_db):
    """Within one priority, a user who sends after another's backlog is served in turn with it, not after it;
    unnamed requests are one more user; each user's requests stay in the order sent."""
    url = declared(redis_db(), SYNTHETIC)
    app = _app_for(url)
    results = [send(app, f"alice {i}", user="alice") for i in range(4)]
    results += [send(app, f"bob {i}", user="bob") for i in range(2)]
    results.append(send(app, "nobody 0"))
    expected = ["alice 0", "bob 0", "nobody 0", "alice 1", "bob 1", "alice 2", "alice 3"]
    assert queued(redis.Redis.from_url(url))[1] == expected
    with serving(url, "users"):
        assert served_order(app, results) == expected


def test_tenants_alternate_whatever_number_of_users_they_name(redis_db):
    """Tenant A sends six requests as six users, then tenant B six as one user: the replica takes them A, B, A,
    B, ...: inventing users gains a tenant no turns (one lane per user gave A's six first)."""
    url = declared(redis_db(), SYNTHETIC)
    app = _app_for(url)
    results = [send(app, f"A {i}", tenant="A", user=f"made-up {i}") for i in range(6)]
    results += [send(app, f"B {i}", tenant="B", user="b") for i in range(6)]
    expected = [f"{t} {i}" for i in range(6) for t in "AB"]
    assert queued(redis.Redis.from_url(url))[1] == expected
    with serving(url, "tenants"):
        assert served_order(app, results) == expected


def test_a_new_user_takes_its_turn_within_its_tenant_only(redis_db):
    """Tenant A's user u1 sends three requests, tenant B three, then A's new user u2 two: u2 alternates with u1
    inside A's turns (its requests move ahead of u1's later ones), and A and B still alternate; B's turns do not
    move. One lane per user gave u2 turns of its own between B's."""
    url = declared(redis_db(), SYNTHETIC)
    app = _app_for(url)
    results = [send(app, f"u1 {i}", tenant="A", user="u1") for i in range(3)]
    results += [send(app, f"B {i}", tenant="B") for i in range(3)]
    results += [send(app, f"u2 {i}", tenant="A", user="u2") for i in range(2)]
    expected = ["u1 0", "B 0", "u2 0", "B 1", "u1 1", "B 2", "u2 1", "u1 2"]
    assert queued(redis.Redis.from_url(url))[1] == expected
    with serving(url, "tenant-users"):
        assert served_order(app, results) == expected


def test_a_user_name_does_not_join_another_tenants_lane(redis_db):
    """Tenants A and B and the unnamed tenant all send as user "alice": each is a lane of its own, so they
    alternate (one lane for the name gave A's three, then B's, then the unnamed one's)."""
    url = declared(redis_db(), SYNTHETIC)
    app = _app_for(url)
    for tenant in ("A", "B", None):
        for i in range(3 if tenant else 1):
            send(app, f"{tenant} {i}", tenant=tenant, user="alice")
    assert queued(redis.Redis.from_url(url))[1] == ["A 0", "B 0", "None 0", "A 1", "B 1", "A 2", "B 2"]


def test_users_alternate_within_a_tenant(redis_db):
    """Within one tenant, users take turns and each user's requests stay in the order sent, as without tenants."""
    url = declared(redis_db(), SYNTHETIC)
    app = _app_for(url)
    for user, count in (("x", 3), ("y", 2)):
        for i in range(count):
            send(app, f"{user} {i}", tenant="A", user=user)
    assert queued(redis.Redis.from_url(url))[1] == ["x 0", "y 0", "x 1", "y 1", "x 2"]


def test_a_requeued_request_keeps_its_priority(redis_db):
    """An interactive request whose pool child is killed mid-request goes back to the head of the interactive
    list: once the replica has reloaded, it runs again before the interactive request sent after it, and both
    before the batch request sent before that."""
    url = declared(redis_db(), SYNTHETIC)
    app = _app_for(url)
    with serving(url, "requeue-priority"):
        first = app.send_task("replicadp.generate", kwargs=lasting(2.0, prompt="killed", priority="interactive"))
        pid = wait_for_step(SimpleNamespace(app=app), first.id, 1)["pid"]
        results = [first, send(app, "batch", priority="batch"), send(app, "interactive", priority="interactive")]
        os.kill(pid, signal.SIGKILL)
        assert served_order(app, results) == ["killed", "interactive", "batch"]
        assert int(redis.Redis.from_url(url).get(ATTEMPTS_KEY + first.id)) == 2


def test_bad_priority_tenant_or_user_is_refused_before_it_is_sent(redis_db):
    """A priority, tenant or user a replica would refuse raises InvalidRequest naming the field in the caller,
    and nothing is queued; so does Celery's own priority option, which replicadp does not read. A user with an
    invisible or control character (zero-width space, bidi override, C1's NEL, a line separator, a surrogate, an
    unassigned code point) is refused, saying so."""
    url = declared(redis_db(), SYNTHETIC)
    app = _app_for(url)
    for fields, field in (({"priority": "urgent"}, "priority"), ({"priority": 1}, "priority"),
                          ({"user": ""}, "user"), ({"user": "a\x00b"}, "user"), ({"user": "u" * 257}, "user"),
                          ({"tenant": ""}, "tenant"), ({"tenant": "-a"}, "tenant"), ({"tenant": "a b"}, "tenant"),
                          ({"tenant": "t" * 65}, "tenant"), ({"tenant": 7}, "tenant")):
        with pytest.raises(InvalidRequest) as caught:
            send(app, "refused", **fields)
        assert caught.value.field == field and str(caught.value).startswith(f"{field}=")
    for char in ("\u200b", "\u202e", "\x85", "\u2028", "\ud800", "\U000e0080"):
        with pytest.raises(InvalidRequest, match="invisible and control characters are refused") as caught:
            send(app, "refused", user=f"ali{char}ce")
        assert caught.value.field == "user" and str(caught.value).startswith("user=")
    with pytest.raises(InvalidRequest, match="apply_async priority option"):
        app.send_task("replicadp.generate", kwargs=SHORT, priority=9)
    assert queue_depth(redis.Redis.from_url(url), SYNTHETIC) == 0
    assert [p.level for p in Priority] == [0, 3, 6]


def test_fifo_scheduling_keeps_one_list_in_arrival_order(redis_db):
    """REPLICADP_SCHEDULING=fifo (the benchmarks' baseline): every request, whatever its priority and user, waits
    in one list in the order it was sent."""
    url = declared(redis_db(), SYNTHETIC)
    code = ("from client.api import use_redis; import sys; use_redis(sys.argv[1]); "
            "from replicadp_tasks import generate\n"
            "for p, u in (('batch', 'a'), ('interactive', 'b'), ('normal', 'a'), ('batch', None)):\n"
            "    generate.delay(prompt=f'{p} {u}', num_inference_steps=1, priority=p, user=u)")
    subprocess.run([sys.executable, "-c", code, url], env={**os.environ, "REPLICADP_SCHEDULING": "fifo"},
                   check=True, timeout=60)
    assert queued(redis.Redis.from_url(url)) == [["batch a", "interactive b", "normal a", "batch None"], [], []]
