"""Raw messages pushed straight onto the queue, as anything holding the Redis password can: whatever arrives, a
replica's main process survives it, refuses what is not a request it serves (acknowledged, recorded as dead with
its reason, counted, failed under its task id when it has one), and both replicas go on serving at prefetch 1."""

import base64
import json
import uuid
from types import SimpleNamespace

import pytest
import redis
from celery import states
from prometheus_client import CollectorRegistry

from client.api import _app_for
from client.ops.metrics import Exporter
from client.ops.status import queue_head
from conftest import start_replicas
from helpers import SYNTHETIC, lasting, model_queue, parent_of, queue_depth, wait_for
from replicadp_tasks.broker import message
from replicadp_tasks.contract import MessageRefused
from replicadp_tasks.contract.keys import DEAD_KEY, REPLICA_KEY, STATS_KEY


def envelope(body=None, headers=None, properties=None, **fields) -> dict:
    """A request as Celery 5's producer sends it (protocol 2 in kombu's Redis envelope), with parts replaced."""
    task_id = str(uuid.uuid4())
    body = [[], {"prompt": "raw", "height": 64, "width": 64, "num_frames": 5, "num_inference_steps": 1},
            {"callbacks": None, "errbacks": None, "chain": None, "chord": None}] if body is None else body
    return {
        "body": base64.b64encode(json.dumps(body).encode()).decode(),
        "content-encoding": "utf-8", "content-type": "application/json",
        "headers": {"lang": "py", "task": "replicadp.generate", "id": task_id, "shadow": None, "eta": None,
                    "expires": None, "group": None, "group_index": None, "retries": 0, "timelimit": [None, None],
                    "root_id": task_id, "parent_id": None, "argsrepr": "()", "kwargsrepr": "{}", "origin": "test",
                    "ignore_result": False, "replaced_task_nesting": 0, "stamped_headers": None, "stamps": {},
                    **(headers or {})},
        "properties": {"correlation_id": task_id, "reply_to": "", "delivery_mode": 2,
                       "delivery_info": {"exchange": "", "routing_key": model_queue(SYNTHETIC)}, "priority": 0,
                       "body_encoding": "base64", "delivery_tag": str(uuid.uuid4()), **(properties or {})},
        **fields,
    }


def without(env: dict, part: str, key: str) -> dict:
    del env[part][key]
    return env


def nested_body(depth: int) -> dict:
    """A request whose kwargs nest a list `depth` deep, as text (json.dumps of it would recurse as deep)."""
    env = envelope()
    text = '[[], {"prompt": "raw", "loras": ' + "[" * depth + "]" * depth + '}, {}]'
    env["body"] = base64.b64encode(text.encode()).decode()
    return env


# Each: (what it is, raw bytes, whether it names a task id a client could wait on). The first eight crashed a
# replica's main process, looped its consumer or left a client waiting forever before the check existed.
POISON = [
    ("body a JSON string", envelope(body="just a string"), True),
    ("timelimit 'abc'", envelope(headers={"timelimit": "abc"}), True),
    ("no id header", without(envelope(), "headers", "id"), False),
    ("envelope not JSON", b"{this is not json", False),
    ("envelope a JSON list", [1, 2, 3], False),
    ("body not base64", envelope(body="x") | {"body": "%%% not base64 %%%"}, True),
    ("null delivery tag", envelope(properties={"delivery_tag": None}), True),
    ("kwargs a list", envelope(body=[[], [1, 2], {}]), True),
    ("no task header", without(envelope(), "headers", "task"), True),
    ("eta in 2999", envelope(headers={"eta": "2999-01-01T00:00:00+00:00"}), True),
    ("another task", envelope(headers={"task": "celery.backend_cleanup"}), True),
    ("unknown header", envelope(headers={"x-run-this": "now"}), True),
    ("a callback", envelope(body=[[], {"prompt": "raw"}, {"callbacks": [{"task": "os.system"}]}]), True),
    ("two positional args", envelope(body=[["a", "b"], {}, {}]), True),
    ("timelimit past the replica's", envelope(headers={"timelimit": [10 ** 9, None]}), True),
    ("not UTF-8", b"\xff\xfe{}", False),
    # Nested past the JSON decoder's recursion: its RecursionError had escaped the check.
    ("envelope nested 100000 deep", b"[" * 100_000 + b"]" * 100_000, False),
    ("kwargs nested 100000 deep", nested_body(100_000), True),
]


def raw(message_) -> bytes:
    return message_ if isinstance(message_, bytes) else json.dumps(message_).encode()


def task_id(message_) -> str | None:
    return message.task_id_of(message_) if isinstance(message_, dict) else None


@pytest.fixture(scope="module")
def group(redis_db):
    url = redis_db()
    replicas = start_replicas(2, url, "messages", model=SYNTHETIC)
    yield SimpleNamespace(url=url, names=replicas.names, app=_app_for(url), redis=redis.Redis.from_url(url))
    replicas.stop()


def processes(group) -> dict:
    """replica -> (main pid, pool child pid), from what each published when its child loaded the model."""
    out = {}
    for name in group.names:
        child = json.loads(group.redis.get(REPLICA_KEY + name))["pid"]
        out[name] = (parent_of(child), child)
    return out


@pytest.mark.parametrize("what,message_,named", POISON, ids=[p[0] for p in POISON])
def test_check_refuses_each_poison_message(what, message_, named):
    """The check alone: each message above is refused with a reason, and the task id is kept when it has one."""
    with pytest.raises(MessageRefused) as refused:
        message.check(raw(message_))
    assert str(refused.value)
    assert refused.value.task_id == (task_id(message_) if named else None)


def test_check_passes_what_celery_sends(group):
    """What replicadp's producer sends (delay, apply_async with a task id and expires) passes the check."""
    with group.app.connection_for_write() as conn:
        for send in ({"args": ["a fox"]}, {"kwargs": {"prompt": "x"}, "task_id": "mine", "expires": 600}):
            group.app.send_task("replicadp.generate", connection=conn, queue="checked-here", **send)
    sent = group.redis.lrange("checked-here", 0, -1)
    group.redis.delete("checked-here")
    assert len(sent) == 2
    for item in sent:
        message.check(item)


def test_check_refuses_a_message_past_the_bound():
    """A message larger than a request with the largest first frame is refused before it is parsed."""
    with pytest.raises(MessageRefused, match="more than"):
        message.check(b" " * (message.MAX_MESSAGE_BYTES + 1))


def test_queue_readers_survive_garbage_at_the_head(redis_db):
    """status, metrics and health read the next request's headers: garbage at the head reads as no headers."""
    client = redis.Redis.from_url(redis_db())
    for garbage in (b"{this is not json", b"[1, 2, 3]", b'{"headers": "no"}', b"\xff"):
        client.delete(model_queue())
        client.lpush(model_queue(), garbage)
        depths, head = queue_head(client, "tiny")
        assert sum(depths.values()) == 1 and head == {}


def test_every_poison_message_is_refused_and_both_replicas_serve_a_canary(group):
    """All the messages above pushed onto the queue at once: neither replica's main process nor pool child
    restarts, each message is gone from the queue and from kombu's unacked hash, recorded as dead with its reason
    and counted, those with a task id get a FAILURE a client can read, and both replicas then serve a canary
    within seconds, each still reserving one request at a time (prefetch 1)."""
    before = processes(group)
    refused_before = int(group.redis.hget(STATS_KEY, "refused_messages") or 0)
    group.redis.delete(DEAD_KEY)
    group.redis.lpush(model_queue(SYNTHETIC), *[raw(m) for _, m, _ in POISON])

    wait_for(lambda: group.redis.llen(DEAD_KEY) >= len(POISON), "every poison message to be refused", timeout=30)
    canaries = [group.app.send_task("replicadp.generate", kwargs=lasting(1.0, seed=s)) for s in range(2)]
    results = [c.get(timeout=30) for c in canaries]
    assert {r["replica"] for r in results} == set(group.names)

    assert processes(group) == before
    assert queue_depth(group.redis, SYNTHETIC) == 0
    wait_for(lambda: group.redis.hlen("unacked") == 0, "the canaries' acknowledgements", timeout=10)
    dead = [json.loads(d) for d in group.redis.lrange(DEAD_KEY, 0, -1)]
    assert len(dead) == len(POISON) and all(d["reason"].startswith("refused: ") for d in dead)
    assert int(group.redis.hget(STATS_KEY, "refused_messages")) - refused_before == len(POISON)
    for what, message_, named in POISON:
        if named:
            meta = group.app.backend.get_task_meta(task_id(message_))
            assert meta["status"] == states.FAILURE, what
            assert type(meta["result"]).__name__ == "MessageRefused", what
            assert any(d["task_id"] == task_id(message_) and str(meta["result"]) in d["reason"] for d in dead), what
    stats = group.app.control.inspect(timeout=2).stats()
    assert {name: stats[name]["prefetch_count"] for name in group.names} == dict.fromkeys(group.names, 1)
    registry = CollectorRegistry()
    exporter = Exporter(registry)
    exporter.redis = group.redis  # this group's database, not the session's
    assert registry.get_sample_value("replicadp_messages_refused_total") - refused_before == len(POISON)
    assert registry.get_sample_value("replicadp_dead_letters") == len(POISON)
