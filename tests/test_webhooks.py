"""Webhooks (replicadp_tasks/webhooks/events.py) as a receiver sees them: a real HTTP receiver on 127.0.0.1 (a fixture's
http.server), a real replica of the tiny model that may reach it (REPLICADP_FETCH_ALLOW=127.0.0.1/32) and signs
with a secret, and real gateways; events verified the way docs/http.md tells a receiver to."""

import hashlib
import hmac
import json
import threading
import time
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
import redis
from click.testing import CliRunner
from prometheus_client import CollectorRegistry
from conftest import start_replicas
from helpers import SYNTHETIC, lasting, wait_for, wait_for_step
from test_http import gateway, post

from client.api import _app_for
from client.cli import main as cli
from client.local.embedded import EmbeddedServer
from client.ops.metrics import Exporter
from client.submit import request_id_for
from replicadp_tasks.contract import (Event, InvalidRequest, RequestCancelled, Webhook, input_key, tenant_secret,
                                      validate_request)
from replicadp_tasks.contract.keys import (CANCEL_CHANNEL, CANCEL_KEY, STATS_KEY, WEBHOOK_DUE_KEY, WEBHOOK_EVENTS_KEY,
                                           WEBHOOK_SENT_KEY)
from replicadp_tasks.contract.webhook import DEFAULT_EVENTS
from replicadp_tasks.settings import Settings
from replicadp_tasks.webhooks import ATTEMPTS, MAX_EVENTS_PER_REQUEST, backoff, emit

SECRET = "test-webhook-secret-0123456789abcdef"
CLAIM_S = 10  # REPLICADP_WEBHOOK_CLAIM where a test waits for a claim to end (the default: 60)
SMALL = {"prompt": "a fox in snow", "height": 64, "width": 64, "num_frames": 5, "num_inference_steps": 2}
SMALL_FORM = {"prompt": "a fox in snow", "size": "64x64", "num_frames": "5", "num_inference_steps": "2"}


def verify(secret: str, header: str, body: bytes) -> bool:
    """A receiver's check of X-Replicadp-Signature, as docs/http.md shows it."""
    fields = dict(part.split("=", 1) for part in header.split(","))
    expected = hmac.new(secret.encode(), f"{fields['t']}.".encode() + body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, fields["v1"])


class Receiver:
    """A webhook receiver on `host`: keeps every POST by path (with `at`, when it arrived: time.monotonic()),
    answers a path's scripted statuses first (then 200), and holds every answer on a path while `holds[path]` is
    not set."""

    def __init__(self, host: str = "127.0.0.1"):
        self.posts: dict[str, list] = defaultdict(list)
        self.statuses: dict[str, list[int]] = defaultdict(list)
        self.holds: dict[str, threading.Event] = {}
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.posts[self.path].append(SimpleNamespace(headers=self.headers, body=body,
                                                                 payload=json.loads(body), at=time.monotonic()))
                hold = receiver.holds.get(self.path)
                if hold is not None:
                    hold.wait(120)
                with receiver.lock:
                    status = receiver.statuses[self.path].pop(0) if receiver.statuses[self.path] else 200
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address):  # an answer to a sender that timed out and left
                pass

        self.server = Server((host, 0), Handler)
        self.base = f"http://{host}:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, path: str) -> str:
        return self.base + path

    def stop(self) -> None:
        for hold in self.holds.values():
            hold.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def receiver():
    server = Receiver()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def hooked(redis_db, tiny_model):
    """One tiny-model replica on a database of its own that may reach 127.0.0.1 (only) and signs with SECRET."""
    url = redis_db()
    group = start_replicas(1, url, "webhooks", REPLICADP_FETCH_ALLOW="127.0.0.1/32", REPLICADP_WEBHOOK_SECRET=SECRET)
    try:
        yield SimpleNamespace(url=url, app=_app_for(url), redis=redis.Redis.from_url(url), replica=group.names[0])
    finally:
        group.stop()


def posts_at(receiver: Receiver, path: str, n: int = 1) -> list:
    """The POSTs to `path`, once there are at least `n`."""
    return wait_for(lambda: receiver.posts[path] if len(receiver.posts[path]) >= n else None,
                    f"{n} POST(s) to {path}")


def queued(client: redis.Redis, task_id: str) -> set[str]:
    """The ids of the events queued for `task_id`, ever."""
    return {k.decode() for k in client.hkeys(WEBHOOK_SENT_KEY + task_id)}


def delivered(client: redis.Redis, event_id: str) -> bool:
    """Whether `event_id` has left the queue (sent, or given up)."""
    return not client.hexists(WEBHOOK_EVENTS_KEY, event_id) and client.zscore(WEBHOOK_DUE_KEY, event_id) is None


def give_ups(client: redis.Redis) -> int:
    return int(client.hget(STATS_KEY, "webhook_give_ups") or 0)


def progress_dropped(client: redis.Redis) -> int:
    return int(client.hget(STATS_KEY, "webhook_progress_dropped") or 0)


def scraped(client: redis.Redis, name: str) -> float:
    """`name`'s value as `replicadp metrics` serves it, scraped from `client`'s database."""
    registry = CollectorRegistry()
    Exporter(registry).redis = client
    return registry.get_sample_value(name)


# --- validation, in this process ------------------------------------------------------------------------

@pytest.mark.parametrize("fields, field, why", [
    ({"webhook": "ftp://example.com/hook"}, "webhook", "only http and https"),
    ({"webhook": "http://example.com/" + "a" * 2048}, "webhook", "the limit is 2048"),
    ({"webhook": "https://user:pw@example.com/hook"}, "webhook", "credentials in the URL"),
    ({"webhook": "http://example.com/a hook"}, "webhook", "without spaces"),
    ({"webhook": "http://example.com:99999/hook"}, "webhook", "not a valid URL"),
    ({"webhook": 5}, "webhook", "must be a string"),
    ({"webhook_events": ["completed"]}, "webhook_events", "without a webhook"),
    ({"webhook": "http://example.com/hook", "webhook_events": ["done"]}, "webhook_events", "non-empty list of"),
    ({"webhook": "http://example.com/hook", "webhook_events": "completed"}, "webhook_events", "non-empty list of"),
    ({"webhook": "http://example.com/hook", "webhook_events": []}, "webhook_events", "non-empty list of"),
])
def test_bad_webhook_fields_are_refused_by_name(fields, field, why):
    """A webhook that is not an http(s) URL of bounded length without credentials, or events that are not a
    non-empty list of the four, is refused with InvalidRequest naming the field and the value."""
    with pytest.raises(InvalidRequest, match=why) as caught:
        validate_request({**SMALL, **fields})
    assert caught.value.field == field
    assert str(caught.value).startswith(f"{field}=")


def test_webhook_fields_are_not_part_of_the_input():
    """A webhook says how a request is told, not what it makes: the same input key with or without one, and
    `replicadp submit` gives a line the same request_id whatever webhook it names."""
    hooked = {**SMALL, "webhook": "https://example.com/hook", "webhook_events": ["started", "failed"]}
    with_hook, without = validate_request(hooked), validate_request(SMALL)
    assert with_hook == without
    assert input_key(with_hook.params(), "tiny") == input_key(without.params(), "tiny")
    assert request_id_for(hooked) == request_id_for(SMALL)


def test_an_event_is_queued_once_per_task(redis_db):
    """The same event of the same task (a redelivery that finds its stored result) is queued once; the same
    event of another task with the same request_id (a second request) is queued again."""
    client = redis.Redis.from_url(redis_db())
    hook = Webhook("http://127.0.0.1:9/hook", DEFAULT_EVENTS)
    for task_id in ("task-a", "task-a", "task-b"):
        emit(client, hook, Event.COMPLETED, task_id=task_id, request_id="same", replica=None, result={})
    emit(client, hook, Event.STARTED, task_id="task-a", request_id="same", replica=None)  # not asked for
    assert {m.decode() for m in client.zrange(WEBHOOK_DUE_KEY, 0, -1)} == {"task-a.completed", "task-b.completed"}


def test_tenant_secrets_are_derived_and_apart():
    """A tenant's secret is HMAC-SHA256(deployment secret, "replicadp-webhook-tenant:" + tenant), hex: the same
    each time, another for another tenant or another deployment secret, never the deployment secret; a tenant
    id no API key may have is refused, naming `tenant`."""
    a, b = tenant_secret(SECRET, "tenant-a"), tenant_secret(SECRET, "tenant-b")
    assert a == hmac.new(SECRET.encode(), b"replicadp-webhook-tenant:tenant-a", hashlib.sha256).hexdigest()
    assert len({a, b, SECRET, tenant_secret("another deployment", "tenant-a")}) == 4
    with pytest.raises(InvalidRequest) as caught:
        tenant_secret(SECRET, "a tenant")
    assert caught.value.field == "tenant"


def test_webhook_secret_command():
    """`replicadp webhook-secret TENANT` prints the tenant's secret, derived from REPLICADP_WEBHOOK_SECRET; without
    that variable, or with a tenant id no key may have, it exits 2 saying why."""
    printed = CliRunner().invoke(cli, ["webhook-secret", "tenant-b"], env={"REPLICADP_WEBHOOK_SECRET": SECRET})
    assert printed.exit_code == 0, printed.output
    assert printed.output == tenant_secret(SECRET, "tenant-b") + "\n"
    unset = CliRunner().invoke(cli, ["webhook-secret", "tenant-b"], env={"REPLICADP_WEBHOOK_SECRET": ""})
    assert unset.exit_code == 2 and "REPLICADP_WEBHOOK_SECRET is not set" in unset.output
    bad = CliRunner().invoke(cli, ["webhook-secret", "-x"], env={"REPLICADP_WEBHOOK_SECRET": SECRET})
    assert bad.exit_code == 2 and "TENANT" in bad.output


def test_progress_past_a_requests_cap_is_dropped_first(redis_db):
    """A request queues at most MAX_EVENTS_PER_REQUEST events: progress events past MAX_EVENTS_PER_REQUEST - 3
    are dropped (counted in webhook_progress_dropped), and its started and completed are still queued."""
    client = redis.Redis.from_url(redis_db())
    hook = Webhook("http://127.0.0.1:9/hook", frozenset(Event))
    emit(client, hook, Event.STARTED, task_id="capped", request_id="capped", replica=None)
    for step in range(1, 81):
        emit(client, hook, Event.PROGRESS, task_id="capped", request_id="capped", replica=None, step=step,
             total_steps=80)
    emit(client, hook, Event.COMPLETED, task_id="capped", request_id="capped", replica=None, result={})
    ids = queued(client, "capped")
    assert {"capped.started", "capped.completed"} <= ids and len(ids) <= MAX_EVENTS_PER_REQUEST
    assert progress_dropped(client) == 80 - sum(".progress." in i for i in ids) > 0


# --- with a real replica --------------------------------------------------------------------------------

def test_completed_and_failed_events_arrive_signed(hooked, receiver):
    """A request naming a webhook gets its `completed` event, signed with the secret over `<t>.<body>`, with the
    event id in a header and in the payload, its request_id, task id, replica and Result; a request the replica
    refuses gets `failed` with the error's type and message. Nothing else is queued by default."""
    done = hooked.app.send_task("replicadp.generate", kwargs={**SMALL, "webhook": receiver.url("/done"),
                                                              "request_id": "hook-done"})
    result = done.get(timeout=120)
    bad = hooked.app.send_task("replicadp.generate", kwargs={**SMALL, "num_frames": 6,
                                                             "webhook": receiver.url("/bad")})
    with pytest.raises(InvalidRequest, match="num_frames"):
        bad.get(timeout=120)

    [completed] = posts_at(receiver, "/done")
    assert verify(SECRET, completed.headers["X-Replicadp-Signature"], completed.body)
    assert not verify("another secret", completed.headers["X-Replicadp-Signature"], completed.body)
    assert completed.headers["Content-Type"] == "application/json"
    assert completed.headers["X-Replicadp-Event"] == "completed"
    assert completed.headers["X-Replicadp-Event-Id"] == completed.payload["id"] == f"{done.id}.completed"
    payload = completed.payload
    assert (payload["event"], payload["request_id"], payload["task_id"], payload["replica"]) == (
        "completed", "hook-done", done.id, hooked.replica)
    assert payload["result"] == result and isinstance(payload["time"], float)
    assert queued(hooked.redis, done.id) == {f"{done.id}.completed"}

    [failed] = posts_at(receiver, "/bad")
    assert verify(SECRET, failed.headers["X-Replicadp-Signature"], failed.body)
    assert (failed.payload["event"], failed.payload["request_id"], failed.payload["task_id"]) == (
        "failed", bad.id, bad.id)
    assert failed.payload["error"]["type"] == "InvalidRequest"
    assert failed.payload["error"]["message"].startswith("num_frames=6:")


def test_started_and_progress_when_asked(hooked, receiver):
    """Asked for started, progress and completed, a request gets each, once per event id, and every progress
    event says its step out of the request's steps."""
    task = hooked.app.send_task("replicadp.generate", kwargs={
        **SMALL, "num_inference_steps": 4, "webhook": receiver.url("/all"),
        "webhook_events": ["started", "progress", "completed"]})
    task.get(timeout=120)
    ids = queued(hooked.redis, task.id)
    posts = posts_at(receiver, "/all", len(ids))
    assert sorted(p.payload["id"] for p in posts) == sorted(ids)  # each queued event sent, none twice
    events = [p.payload["event"] for p in posts]
    assert {"started", "progress", "completed"} == set(events) and events.count("started") == 1
    for p in posts:
        assert verify(SECRET, p.headers["X-Replicadp-Signature"], p.body)
        if p.payload["event"] == "progress":
            assert p.payload["total_steps"] == 4 and 1 <= p.payload["step"] <= 4
            assert p.payload["id"] == f"{task.id}.progress.{p.payload['step']}"


def test_receiver_errors_are_retried_and_4xx_is_final(hooked, receiver):
    """A receiver answering 429 and then 503 gets the same event (same id, each attempt signed) a third time,
    which it answers 200: delivered, no give-up. One answering 404 gets one POST: given up at once, counted."""
    before = give_ups(hooked.redis)
    receiver.statuses["/flaky"] = [429, 503]
    receiver.statuses["/gone"] = [404]
    flaky = hooked.app.send_task("replicadp.generate", kwargs={**SMALL, "webhook": receiver.url("/flaky")})
    gone = hooked.app.send_task("replicadp.generate", kwargs={**SMALL, "webhook": receiver.url("/gone")})
    flaky.get(timeout=120), gone.get(timeout=120)

    attempts = posts_at(receiver, "/flaky", 3)
    assert {p.headers["X-Replicadp-Event-Id"] for p in attempts} == {f"{flaky.id}.completed"}
    assert all(verify(SECRET, p.headers["X-Replicadp-Signature"], p.body) for p in attempts)
    wait_for(lambda: delivered(hooked.redis, f"{flaky.id}.completed"), "the flaky receiver's event to be sent")
    wait_for(lambda: give_ups(hooked.redis) == before + 1, "the 404 to be given up")
    assert delivered(hooked.redis, f"{gone.id}.completed")
    assert len(receiver.posts["/gone"]) == 1 and len(receiver.posts["/flaky"]) == 3


def test_events_never_block_the_replica(hooked, receiver):
    """While the receiver holds its answer to one request's event, the replica serves the next request to its
    end; the held event is then delivered once the receiver answers."""
    before = give_ups(hooked.redis)
    receiver.holds["/held"] = threading.Event()
    first = hooked.app.send_task("replicadp.generate", kwargs={**SMALL, "webhook": receiver.url("/held")})
    second = hooked.app.send_task("replicadp.generate", kwargs={**SMALL, "seed": 1})
    posts_at(receiver, "/held")
    assert second.get(timeout=120)["replica"] == hooked.replica
    assert not delivered(hooked.redis, f"{first.id}.completed")  # no POST of it has been answered yet
    receiver.holds["/held"].set()
    wait_for(lambda: delivered(hooked.redis, f"{first.id}.completed"), "the held event to be delivered")
    assert give_ups(hooked.redis) == before


def test_a_tenants_events_are_signed_with_its_own_secret(hooked, receiver):
    """The events of a request sent for tenant B (its `tenant` kwarg, as the gateway sets it), `completed` and
    `failed`, are signed with B's secret (what `replicadp webhook-secret tenant-b` prints): they verify with that,
    and neither with the deployment secret nor with tenant A's; an event without a tenant keeps the deployment
    secret."""
    printed = CliRunner().invoke(cli, ["webhook-secret", "tenant-b"], env={"REPLICADP_WEBHOOK_SECRET": SECRET})
    done = hooked.app.send_task("replicadp.generate", kwargs={**SMALL, "webhook": receiver.url("/tenant-b"),
                                                              "tenant": "tenant-b", "seed": 7})
    done.get(timeout=120)
    bad = hooked.app.send_task("replicadp.generate", kwargs={**SMALL, "num_frames": 6, "tenant": "tenant-b",
                                                             "webhook": receiver.url("/tenant-b-bad")})
    with pytest.raises(InvalidRequest):
        bad.get(timeout=120)
    emit(hooked.redis, Webhook(receiver.url("/no-tenant"), DEFAULT_EVENTS), Event.COMPLETED,
         task_id="no-tenant-task", request_id="no-tenant-task", replica=None, result={})
    [completed] = posts_at(receiver, "/tenant-b")
    [failed] = posts_at(receiver, "/tenant-b-bad")
    assert (completed.payload["event"], failed.payload["event"]) == ("completed", "failed")
    for event in (completed, failed):
        header = event.headers["X-Replicadp-Signature"]
        assert verify(printed.output.strip(), header, event.body)
        assert not verify(SECRET, header, event.body)
        assert not verify(tenant_secret(SECRET, "tenant-a"), header, event.body)
    [plain] = posts_at(receiver, "/no-tenant")
    assert verify(SECRET, plain.headers["X-Replicadp-Signature"], plain.body)


def test_a_hanging_receiver_does_not_delay_another_tenants_events(hooked):
    """Tenant A's receiver holds every answer (each of its sends waits out the read timeout) and A has 6 events
    due first; tenant B's `completed`, queued after them to another receiver, arrives while A's receiver has had
    fewer than 6 POSTs (one at a time: a host at its cap is skipped, not waited on), signed with B's secret. Had
    been: both senders of the replica took A's events, 5 s each, and B's came only after all 6 of A's (the
    same with 4 senders and 38-41 s). Once A's receiver answers, A's events are delivered too."""
    hung, prompt = Receiver(), Receiver()
    hung.holds["/a"] = threading.Event()
    try:
        for n in range(6):
            emit(hooked.redis, Webhook(hung.url("/a"), DEFAULT_EVENTS, "tenant-a"), Event.COMPLETED,
                 task_id=f"hang-{n}", request_id=f"hang-{n}", replica=None, result={})
        emit(hooked.redis, Webhook(prompt.url("/b"), DEFAULT_EVENTS, "tenant-b"), Event.COMPLETED,
             task_id="prompt-b", request_id="prompt-b", replica=None, result={})
        [b] = posts_at(prompt, "/b")
        assert len(hung.posts["/a"]) < 6, "B's event waited for every one of A's"
        assert not hung.holds["/a"].is_set()
        assert verify(tenant_secret(SECRET, "tenant-b"), b.headers["X-Replicadp-Signature"], b.body)
        hung.holds["/a"].set()
        for n in range(6):
            wait_for(lambda: delivered(hooked.redis, f"hang-{n}.completed"), f"A's event {n} to be sent")
        assert {p.payload["id"] for p in hung.posts["/a"]} == {f"hang-{n}.completed" for n in range(6)}
    finally:
        hung.stop()
        prompt.stop()


def test_a_failing_receiver_gets_five_attempts_at_the_documented_gaps(hooked, receiver):
    """A receiver that answers 500 every time gets exactly ATTEMPTS (5) POSTs of the event, the gaps between
    them at least 1, 2, 4 and 8 s (as docs/http.md says); then it is given up, once, and counted in
    `replicadp metrics` as replicadp_webhook_give_ups_total."""
    before = give_ups(hooked.redis)
    receiver.statuses["/failing"] = [500] * (ATTEMPTS + 2)
    emit(hooked.redis, Webhook(receiver.url("/failing"), DEFAULT_EVENTS), Event.COMPLETED, task_id="failing",
         request_id="failing", replica=None, result={})
    wait_for(lambda: give_ups(hooked.redis) == before + 1, "the event to be given up", timeout=120)
    assert delivered(hooked.redis, "failing.completed")
    posts = receiver.posts["/failing"]
    assert len(posts) == ATTEMPTS == 5
    gaps = [later.at - earlier.at for earlier, later in zip(posts, posts[1:])]
    assert [backoff(n) for n in range(1, ATTEMPTS)] == [1, 2, 4, 8]
    assert all(gap >= backoff(n) - 0.01 for n, gap in enumerate(gaps, 1)), gaps
    assert scraped(hooked.redis, "replicadp_webhook_give_ups_total") == give_ups(hooked.redis)


@pytest.mark.cluster
def test_an_attempt_whose_outcome_redis_missed_is_not_made_again(receiver, tmp_path):
    """A sender cannot tell Redis how the first attempt went (Redis pauses writes, `CLIENT PAUSE`, from before
    its answer until past the sender's socket timeout): the event is taken again when its claim ends
    (REPLICADP_WEBHOOK_CLAIM, 10 s here), and the receiver, answering 500 every time, still gets exactly 5 POSTs,
    the second of them a claim after the first. Had been: the attempt was counted only once told, so that one was
    made again: 6 POSTs, and a claim-long gap (the 41-68 s and the 6 attempts seen)."""
    server = EmbeddedServer(tmp_path / "redis")
    url = server.start()
    group = start_replicas(1, url, "webhooks-paused", model=SYNTHETIC, OUTPUT_DIR=str(tmp_path / "out"),
                           REPLICADP_FETCH_ALLOW="127.0.0.1/32", REPLICADP_WEBHOOK_SECRET=SECRET,
                           REPLICADP_WEBHOOK_CLAIM=str(CLAIM_S))
    admin = redis.Redis.from_url(url)
    try:
        receiver.statuses["/paused"] = [500] * (ATTEMPTS + 2)
        receiver.holds["/paused"] = threading.Event()  # the first answer waits until Redis is paused
        emit(admin, Webhook(receiver.url("/paused"), DEFAULT_EVENTS), Event.COMPLETED, task_id="paused",
             request_id="paused", replica=None, result={})
        posts_at(receiver, "/paused")
        admin.execute_command("CLIENT", "PAUSE", 5000, "WRITE")  # past the sender's 2 s socket timeout
        receiver.holds["/paused"].set()  # answered (500) within the sender's read timeout
        wait_for(lambda: give_ups(admin) == 1, "the event to be given up", timeout=180)
        assert delivered(admin, "paused.completed")
    finally:
        group.stop()
        server.stop()
    posts = receiver.posts["/paused"]
    assert len(posts) == ATTEMPTS
    assert posts[1].at - posts[0].at >= CLAIM_S - 1, [p.at - posts[0].at for p in posts]  # the claim ran out


def test_the_claim_setting_is_checked_at_start(monkeypatch):
    """REPLICADP_WEBHOOK_CLAIM: 60 s unset; below 10 s (one attempt's connect and send timeouts, when a second
    sender could take an event the first still sends) it stops start-up, naming the variable and the value."""
    monkeypatch.delenv("REPLICADP_WEBHOOK_CLAIM", raising=False)
    assert Settings.from_env().webhook_claim_s == 60
    monkeypatch.setenv("REPLICADP_WEBHOOK_CLAIM", "10")
    assert Settings.from_env().webhook_claim_s == 10
    monkeypatch.setenv("REPLICADP_WEBHOOK_CLAIM", "9")
    with pytest.raises(SystemExit, match="REPLICADP_WEBHOOK_CLAIM=9 is below 10"):
        Settings.from_env()


def test_progress_events_are_not_retried(hooked, receiver):
    """A progress event that its receiver answers 500 is dropped after that one POST (a later one says more),
    counted in replicadp_webhook_progress_dropped_total, not in give-ups; the request's completed event, to the
    same receiver, is still retried and delivered."""
    before, dropped = give_ups(hooked.redis), progress_dropped(hooked.redis)
    receiver.statuses["/progress"] = [500, 500]
    hook = Webhook(receiver.url("/progress"), frozenset(Event))
    emit(hooked.redis, hook, Event.PROGRESS, task_id="progress", request_id="progress", replica=None, step=1,
         total_steps=2)
    wait_for(lambda: delivered(hooked.redis, "progress.progress.1"), "the progress event to leave the queue")
    emit(hooked.redis, hook, Event.COMPLETED, task_id="progress", request_id="progress", replica=None, result={})
    wait_for(lambda: delivered(hooked.redis, "progress.completed"), "the completed event to be delivered")
    ids = [p.payload["id"] for p in receiver.posts["/progress"]]
    assert ids == ["progress.progress.1", "progress.completed", "progress.completed"]
    assert (give_ups(hooked.redis), progress_dropped(hooked.redis)) == (before, dropped + 1)
    assert scraped(hooked.redis, "replicadp_webhook_progress_dropped_total") == dropped + 1


def test_webhook_addresses_are_checked_at_the_request_and_at_the_send(hooked):
    """A replica allowed 127.0.0.1/32 refuses a request whose webhook is at 127.0.0.2 (loopback, not allowed),
    naming `webhook`; and an event queued for 127.0.0.2 anyway (as if its host's address had changed since the
    request was validated) is given up without a connection to it."""
    other = Receiver("127.0.0.2")
    try:
        refused = hooked.app.send_task("replicadp.generate", kwargs={**SMALL, "webhook": other.url("/x")})
        with pytest.raises(InvalidRequest, match="address 127.0.0.2 .* is loopback, not allowed") as caught:
            refused.get(timeout=120)
        assert caught.value.field == "webhook"
        before = give_ups(hooked.redis)
        emit(hooked.redis, Webhook(other.url("/rebound"), DEFAULT_EVENTS), Event.COMPLETED, task_id="rebound",
             request_id="rebound", replica=None, result={})
        wait_for(lambda: give_ups(hooked.redis) == before + 1, "the sender to give up the event")
        assert delivered(hooked.redis, "rebound.completed")
        assert not other.posts
    finally:
        other.stop()


def test_failures_are_told_where_they_are_seen(redis_db, receiver, tmp_path):
    """`failed` reaches the webhook of a request cancelled before it started (seen in the pool child, before any
    validation) and of one past the hard time limit (seen in the main process, which kills the pool child):
    once each, with the error's type."""
    url = redis_db()
    group = start_replicas(1, url, "webhooks-hard-limit", model=SYNTHETIC, OUTPUT_DIR=str(tmp_path),
                           REPLICADP_SOFT_TIME_LIMIT="0", REPLICADP_TIME_LIMIT="2",
                           REPLICADP_FETCH_ALLOW="127.0.0.1/32", REPLICADP_WEBHOOK_SECRET=SECRET,
                           REPLICADP_WEBHOOK_CLAIM=str(CLAIM_S))
    try:
        app, client = _app_for(url), redis.Redis.from_url(url)
        client.set(CANCEL_KEY + "cancelled-early", 1, ex=600)  # what client.api.cancel_request does, on this DB
        cancelled = app.send_task("replicadp.generate", task_id="cancelled-early",
                                  kwargs={**lasting(1), "webhook": receiver.url("/cancelled")})
        hung = app.send_task("replicadp.generate", kwargs={**lasting(30, prompt="hangs"),
                                                           "webhook": receiver.url("/hung")})
        with pytest.raises(RequestCancelled):
            cancelled.get(timeout=60)
        hung.get(timeout=60, propagate=False)
        [early] = posts_at(receiver, "/cancelled")
        [late] = posts_at(receiver, "/hung")
        assert queued(client, hung.id) == {f"{hung.id}.failed"}
    finally:
        group.stop()
    assert (early.payload["event"], early.payload["error"]["type"]) == ("failed", "RequestCancelled")
    assert (late.payload["event"], late.payload["error"]["type"]) == ("failed", "TimeLimitExceeded")
    assert late.payload["task_id"] == hung.id and late.payload["replica"] == group.names[0]
    assert verify(SECRET, late.headers["X-Replicadp-Signature"], late.body)

# --- through the HTTP gateway ---------------------------------------------------------------------------

def test_gateway_form_webhook_url(hooked, receiver):
    """POST /v1/videos with webhook_url and webhook_events (comma-separated) queues a job whose events arrive,
    their task id the job id; webhook_events naming an unknown event is a 400 naming that field."""
    env = {"REPLICADP_WEBHOOK_SECRET": SECRET, "REPLICADP_FETCH_ALLOW": "127.0.0.1/32"}
    with gateway(hooked.url, "webhooks", **env) as gw:
        answer = post(gw, "/v1/videos", {**SMALL_FORM, "webhook_url": receiver.url("/form"),
                                         "webhook_events": "started, completed"})
        assert answer.status_code == 200, answer.text
        job = answer.json()["id"]
        bad = post(gw, "/v1/videos", {**SMALL_FORM, "webhook_url": receiver.url("/form"),
                                      "webhook_events": "completed,done"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "webhook_events"
    posts = posts_at(receiver, "/form", 2)
    assert {p.payload["event"] for p in posts} == {"started", "completed"}
    assert {p.payload["task_id"] for p in posts} == {job}
    assert all(verify(SECRET, p.headers["X-Replicadp-Signature"], p.body) for p in posts)


@pytest.mark.parametrize("env, why", [
    ({"REPLICADP_WEBHOOK_SECRET": SECRET}, "address 127.0.0.1 of host '127.0.0.1' is loopback, not allowed"),
    ({"REPLICADP_WEBHOOK_SECRET": SECRET, "REPLICADP_FETCH_ALLOW": "127.0.0.1/32", "REPLICADP_WEBHOOKS": "0"},
     "switched off here (REPLICADP_WEBHOOKS=0)"),
    ({"REPLICADP_WEBHOOK_SECRET": "", "REPLICADP_FETCH_ALLOW": "127.0.0.1/32"},
     "REPLICADP_WEBHOOK_SECRET is not set"),
], ids=["no-allow-list", "switched-off", "no-secret"])
def test_gateway_refuses_webhooks_it_may_not_send(redis_db, receiver, env, why):
    """A gateway refuses, with a 400 naming webhook_url, a webhook at 127.0.0.1 unless REPLICADP_FETCH_ALLOW
    lists it, any webhook when REPLICADP_WEBHOOKS=0, and any webhook without a secret to sign it: refused, never
    silently dropped."""
    with gateway(redis_db(), "refusing", **env) as gw:
        answer = post(gw, "/v1/videos", {**SMALL_FORM, "webhook_url": receiver.url("/never")})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "webhook_url" and why in error["message"], error
    assert not receiver.posts["/never"]


@pytest.mark.cluster
def test_failed_event_queued_while_redis_refuses_connections_arrives(receiver, tmp_path):
    """A running request is cancelled, and so fails, while its Redis refuses every new connection (at its client limit,
    `CONFIG SET maxclients 1`, from the request's first step until 10 s after its failure is stored): the pool child
    stores the failure over a connection it holds, but queues the `failed` event over a new one; that event still
    reaches the receiver, signed, once Redis takes connections again (within REPLICADP_REDIS_OUTAGE, as the other
    events). Had been: queued through a client that gave up after its few retries, the event was lost. (A Redis
    killed and restarted does not show it: Celery stores the failure first, waiting for Redis, so the event is
    queued only once Redis is back.) Cancelled, not failed by a soft time limit: the limit's signal can land in the
    middle of a Redis call of a step (the fence keeper, refused too, leaves the steps to ask Redis themselves),
    which closes that held connection: the failure then waits for Redis too (the likely cause of a CI failure)."""
    server = EmbeddedServer(tmp_path / "redis")
    url = server.start()
    group = start_replicas(1, url, "webhooks-refusing", model=SYNTHETIC, OUTPUT_DIR=str(tmp_path / "out"),
                           REPLICADP_FETCH_ALLOW="127.0.0.1/32", REPLICADP_WEBHOOK_SECRET=SECRET,
                           REPLICADP_WEBHOOK_CLAIM=str(CLAIM_S))
    admin = redis.Redis.from_url(url)
    limit = admin.config_get("maxclients")["maxclients"]
    try:
        app = _app_for(url)
        task = app.send_task("replicadp.generate", kwargs={**lasting(30, prompt="fails, Redis refusing"),
                                                           "webhook": receiver.url("/refused")})
        wait_for_step(SimpleNamespace(app=app), task.id, 1)
        admin.config_set("maxclients", 1)
        try:
            # What client.api.cancel_request writes, over the one connection Redis still serves.
            admin.set(CANCEL_KEY + task.id, 1, ex=600)
            admin.publish(CANCEL_CHANNEL, task.id)
            wait_for(lambda: app.backend.get_task_meta(task.id)["status"] == "FAILURE", "the failure to be stored")
            time.sleep(10)  # past the retries of a client that gives up (about 5 s)
        finally:
            admin.config_set("maxclients", limit)
        [failed] = wait_for(lambda: receiver.posts["/refused"], "the failed event once Redis takes connections")
    finally:
        group.stop()
        server.stop()
    assert verify(SECRET, failed.headers["X-Replicadp-Signature"], failed.body)
    assert (failed.payload["event"], failed.payload["task_id"]) == ("failed", task.id)
    assert failed.payload["error"]["type"] == "RequestCancelled"
