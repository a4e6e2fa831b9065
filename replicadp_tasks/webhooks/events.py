"""Webhooks: a request that names a URL (`webhook`) is told of its events there (`webhook_events`: started,
progress, completed, failed; by default completed and failed), each a signed JSON POST.

The replica never waits on a receiver: the pool child only queues an event in Redis (durable across its own
death), and the senders, threads of every replica's main process, take the events that are due and POST them.
An event is delivered at least once: a sender that takes one makes it due again `claim_s` later
(REPLICADP_WEBHOOK_CLAIM, 60 s; its destination's send slot is held as long), so that if it dies
sending, another sender takes it; under normal operation an event is sent by one sender only, and each event id
is queued once (a redelivered request does not queue its events again). A receiver that answers 429 or 5xx, or
none at all, is tried again with exponential backoff, ATTEMPTS times in all (counted when taken, so neither a
sender's death nor a lost Redis reply adds one); any other answer is final. A progress event is tried once.

Tenants: a request sent with an API key carries its owner (`tenant`), and its events are signed with
tenant_secret(deployment secret, tenant), so that a tenant that verifies its own events cannot sign another's.
Destinations: at most PER_HOST_SENDS attempts in flight to one host:port across all senders (a host at its cap
is skipped, not waited on, so one tenant's dead receiver holds that many senders, never all), and a host whose
attempts fail is not tried for a while (HOST_BASE_DELAY_S doubling up to MAX_HOST_DELAY_S).

A webhook may reach only what an image URL may (fetch.py: public addresses, or REPLICADP_FETCH_ALLOW): checked
when the request is validated, and again at each send, connecting only to an address just checked.
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import json
import logging
import socket
import ssl
import threading
import time
import urllib.parse
from dataclasses import dataclass
from enum import StrEnum
from typing import NotRequired, TypedDict

import redis

from ..cluster import connection
from ..inputs import fetch
from ..contract.errors import InvalidRequest
from ..contract.keys import (STATS_KEY, WEBHOOK_ATTEMPTS_KEY, WEBHOOK_BACKOFF_KEY, WEBHOOK_DUE_KEY,
                             WEBHOOK_EVENTS_KEY, WEBHOOK_FAILS_KEY, WEBHOOK_SENDING_KEY, WEBHOOK_SENT_KEY)
from ..contract.records import Result
from ..contract.scheduling import check_tenant
from ..settings import SETTINGS

log = logging.getLogger("replicadp")


class Event(StrEnum):
    STARTED = "started"  # the delivery holds the request's fence and starts computing
    PROGRESS = "progress"  # a denoising step, as often as Progress is reported (tasks.PROGRESS_EVERY_S)
    COMPLETED = "completed"  # the video is stored (or was: a request_id's stored result)
    FAILED = "failed"  # the request failed for good (a requeued request has not)


EVENTS = frozenset(e.value for e in Event)
DEFAULT_EVENTS = frozenset({Event.COMPLETED, Event.FAILED})
MAX_URL_CHARS = 2048  # what web servers and proxies commonly accept; room for a token in the query
# Retries: 1, 2, 4, 8 s apart (each capped at MAX_DELAY_S): a receiver restarting is back within them.
ATTEMPTS = 5
BASE_DELAY_S = 1.0
MAX_DELAY_S = 60.0
# One attempt, once connected (TLS, the request, the answer's status line and headers): a receiver acknowledges
# and works afterwards; a slow one must not hold a sender.
SEND_TIMEOUT_S = 5.0
CONNECT_TIMEOUT_S = 3.0  # per address: a live host accepts in milliseconds; a dead one must not hold a sender
# Attempts in flight to one host:port, all senders together: a receiver that never answers holds one sender.
PER_HOST_SENDS = 1
# After a host's attempt fails (no answer, 429, 5xx), none to it for 1, 2, 4, 8 s (the failures in a row): no
# longer than an event's own backoff, so a lone event keeps its schedule; its other events wait with it.
HOST_BASE_DELAY_S = 1.0
MAX_HOST_DELAY_S = 8.0
# Events queued for one request, ever: progress past MAX_EVENTS_PER_REQUEST - 3 is dropped (counted), so that
# started, completed and failed always have room.
MAX_EVENTS_PER_REQUEST = 64
SCAN = 100  # due events a claim looks through for one whose host is free: the others wait POLL_S
SENDERS = 2  # threads per replica: one receiver that times out does not hold back the events of the others
POLL_S = 0.5  # how often an idle sender looks for due events (a Redis script each time); a busy host's wait
TENANT_SECRET_CONTEXT = "replicadp-webhook-tenant:"  # keys tenant_secret's HMAC to this one use of the secret
MAX_ERROR_CHARS = 1000  # of a failure's message in its event

SIGNATURE_HEADER = "X-Replicadp-Signature"  # t=<unix seconds>,v1=<hex HMAC-SHA256 of "<t>.<body>">
EVENT_ID_HEADER = "X-Replicadp-Event-Id"  # the payload's id: the same on every attempt, for de-duplication
EVENT_HEADER = "X-Replicadp-Event"


@dataclass(frozen=True)
class Webhook:
    """Where a request's events go, and which ones."""

    url: str
    events: frozenset[Event]
    tenant: str | None = None  # the API key's owner that sent the request: whose secret signs its events


class Failure(TypedDict):
    type: str  # the exception's class: InvalidRequest, RequestCancelled, PoisonRequest, SoftTimeLimitExceeded, ...
    message: str


class Payload(TypedDict):
    """The JSON body of a webhook POST."""

    id: str  # the event id: <task id>.<event>, and .<step> for progress
    event: Event
    request_id: str  # the caller's request_id, else the task id
    task_id: str  # Celery's task id: the HTTP gateway's job id
    time: float  # when it happened (unix seconds)
    replica: str | None
    step: NotRequired[int]  # progress
    total_steps: NotRequired[int]  # progress
    result: NotRequired[Result]  # completed: the request's metadata, as generate returns it
    error: NotRequired[Failure]  # failed


class Queued(TypedDict):
    """An event waiting in Redis (WEBHOOK_EVENTS_KEY) for a sender."""

    url: str
    dest: str  # host:port, the unit of isolation (PER_HOST_SENDS, host backoff)
    tenant: str | None  # signs with tenant_secret(...) when set, else with the deployment secret
    payload: Payload


# Queue an event unless its id was queued for this task before (a redelivery), due now by Redis's clock; a
# progress event only while the task has fewer than ARGV[5] events (else counted as dropped).
_QUEUE = ("if ARGV[4] == '1' and redis.call('hlen', KEYS[1]) >= tonumber(ARGV[5]) then "
          "redis.call('hincrby', KEYS[4], 'webhook_progress_dropped', 1) return 0 end "
          "if redis.call('hsetnx', KEYS[1], ARGV[1], 1) == 0 then return 0 end "
          "redis.call('expire', KEYS[1], ARGV[3]) local t = redis.call('time') "
          "redis.call('hset', KEYS[3], ARGV[1], ARGV[2]) "
          "redis.call('zadd', KEYS[2], tonumber(t[1]) + tonumber(t[2]) / 1e6, ARGV[1]) return 1")
# Take the first due event whose host is neither backing off (the event is due again when that ends) nor at its
# cap of sends in flight (it waits ARGV[5] s; the next due event is looked at): it stays queued, due again ARGV[1] s
# later (unless retried or done by then), and its attempt is counted now. An event whose attempts were all taken (its
# last sender died, or lost Redis's reply) is given up instead of being sent again.
_CLAIM = ("local t = redis.call('time') local now = tonumber(t[1]) + tonumber(t[2]) / 1e6 "
          "local due = redis.call('zrangebyscore', KEYS[1], '-inf', now, 'limit', 0, tonumber(ARGV[3])) "
          "for _, eid in ipairs(due) do "
          " local queued = redis.call('hget', KEYS[2], eid) "
          " if not queued then redis.call('zrem', KEYS[1], eid) redis.call('hdel', KEYS[3], eid) else "
          "  local record = cjson.decode(queued) local dest = record.dest or '' "
          "  local most = tonumber(ARGV[6]) if record.payload.event == 'progress' then most = 1 end "
          "  local until_ = tonumber(redis.call('zscore', KEYS[4], dest) or 0) "
          "  local sending = ARGV[4] .. dest "
          "  redis.call('zremrangebyscore', sending, '-inf', now) "
          "  if tonumber(redis.call('hget', KEYS[3], eid) or 0) >= most then "
          "   redis.call('zrem', KEYS[1], eid) redis.call('hdel', KEYS[2], eid) redis.call('hdel', KEYS[3], eid) "
          "   redis.call('hincrby', KEYS[5], most == 1 and 'webhook_progress_dropped' or 'webhook_give_ups', 1) "
          "  elseif until_ > now then redis.call('zadd', KEYS[1], until_, eid) "
          "  elseif redis.call('zcard', sending) >= tonumber(ARGV[2]) then "
          "   redis.call('zadd', KEYS[1], now + tonumber(ARGV[5]), eid) "
          "  else "
          "   local claim = now + tonumber(ARGV[1]) local attempt = redis.call('hincrby', KEYS[3], eid, 1) "
          "   redis.call('zadd', sending, claim, eid) "
          "   redis.call('expire', sending, math.ceil(tonumber(ARGV[1])) + 1) "
          "   redis.call('zadd', KEYS[1], claim, eid) return {eid, queued, attempt} "
          "  end "
          " end "
          "end return false")
# An attempt's end: its host's send slot freed; the host backs off (ARGV[5] '1': ARGV[8] s doubling per failure in
# a row, up to ARGV[9]) or is clear again; then, unless a later claim took the event (its attempts moved past
# ARGV[2]), the event is due again ARGV[6] s from now, or (ARGV[6] '') done, counted in ARGV[7] if not ''.
_DONE = ("local eid, dest = ARGV[1], ARGV[3] redis.call('zrem', ARGV[4] .. dest, eid) "
         "local t = redis.call('time') local now = tonumber(t[1]) + tonumber(t[2]) / 1e6 "
         "if ARGV[5] == '1' then local n = redis.call('hincrby', KEYS[6], dest, 1) "
         " redis.call('zadd', KEYS[5], now + math.min(tonumber(ARGV[9]), tonumber(ARGV[8]) * 2 ^ (n - 1)), dest) "
         "else redis.call('hdel', KEYS[6], dest) redis.call('zrem', KEYS[5], dest) end "
         "if redis.call('hget', KEYS[3], eid) ~= ARGV[2] then return 0 end "
         "if ARGV[6] ~= '' then redis.call('zadd', KEYS[1], now + tonumber(ARGV[6]), eid) return 1 end "
         "redis.call('zrem', KEYS[1], eid) redis.call('hdel', KEYS[2], eid) redis.call('hdel', KEYS[3], eid) "
         "if ARGV[7] ~= '' then redis.call('hincrby', KEYS[4], ARGV[7], 1) end return 1")


def available() -> bool:
    """Whether this process may queue webhook events: switched on, and a secret to sign them with."""
    return SETTINGS.webhooks and bool(SETTINGS.webhook_secret)


def check_webhook(url, events, *, policy: bool, tenant=None) -> Webhook | None:
    """The webhook a request names (None: none): `url` (the `webhook` field) an http(s) URL of at most
    MAX_URL_CHARS, `events` (`webhook_events`) a list of Event values, or None for DEFAULT_EVENTS, signed for
    `tenant` (the `tenant` field: None, or an API key's owner id, scheduling.check_tenant). With `policy`,
    also what this deployment allows: webhooks on (REPLICADP_WEBHOOKS), a secret (REPLICADP_WEBHOOK_SECRET), and
    every address of the host public or in REPLICADP_FETCH_ALLOW (a DNS lookup). Raises InvalidRequest naming
    the field and the value."""
    if url is None:
        if events is not None:
            raise InvalidRequest.of("webhook_events", "given without a webhook", value=events)
        return None
    if not isinstance(url, str):
        raise InvalidRequest.of("webhook", f"must be a string (an http(s) URL), got {type(url).__name__}", value=url)
    if len(url) > MAX_URL_CHARS:
        raise InvalidRequest.of("webhook", f"is {len(url)} characters long; the limit is {MAX_URL_CHARS}",
                                value=url)
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise InvalidRequest.of("webhook", "scheme not allowed; only http and https", value=url)
    if not url.isascii() or any(c.isspace() or not c.isprintable() for c in url):
        raise InvalidRequest.of("webhook", "must be ASCII without spaces or control characters (percent-encode "
                                           "the path, punycode the host)", value=url)
    try:
        valid = bool(parts.hostname) and parts.port != 0
    except ValueError:  # a port that is not a number, or out of range
        valid = False
    if not valid:
        raise InvalidRequest.of("webhook", "not a valid URL", value=url)
    if parts.username is not None:
        raise InvalidRequest.of("webhook", "credentials in the URL are not sent; the receiver verifies the "
                                           f"{SIGNATURE_HEADER} header instead", value=url)
    if events is None:
        chosen = DEFAULT_EVENTS
    elif isinstance(events, (list, tuple)) and events and all(isinstance(e, str) and e in EVENTS for e in events):
        chosen = frozenset(Event(e) for e in events)
    else:
        raise InvalidRequest.of("webhook_events", f"must be a non-empty list of {', '.join(Event)}", value=events)
    tenant = check_tenant(tenant)
    if policy:
        if not SETTINGS.webhooks:
            raise InvalidRequest.of("webhook", "webhooks are switched off here (REPLICADP_WEBHOOKS=0)", value=url)
        if not SETTINGS.webhook_secret:
            raise InvalidRequest.of("webhook", "webhooks are not set up here: they are signed, and "
                                               "REPLICADP_WEBHOOK_SECRET is not set", value=url)
        fetch.target(url, SETTINGS.fetch_allow, lambda why: InvalidRequest.of("webhook", why, value=url))
    return Webhook(url, chosen, tenant)


def event_id(task_id: str, event: Event, step: int | None = None) -> str:
    return f"{task_id}.{event}" if step is None else f"{task_id}.{event}.{step}"


def emit(client: redis.Redis, webhook: Webhook | None, event: Event, *, task_id: str, request_id: str,
         replica: str | None, **fields) -> None:
    """Queue `event` (with its `fields`: Payload's) for `webhook`, if it asks for it and it was not queued for
    this task before. A Redis error is logged, never raised: telling the caller must not fail the request."""
    if webhook is None or event not in webhook.events:
        return
    eid = event_id(task_id, event, fields.get("step"))
    payload = Payload(id=eid, event=event, request_id=request_id, task_id=task_id, time=time.time(),
                      replica=replica, **fields)
    queued = Queued(url=webhook.url, dest=destination(webhook.url), tenant=webhook.tenant, payload=payload)
    try:
        client.eval(_QUEUE, 4, WEBHOOK_SENT_KEY + task_id, WEBHOOK_DUE_KEY, WEBHOOK_EVENTS_KEY, STATS_KEY, eid,
                    json.dumps(queued, default=repr), SETTINGS.result_ttl_s, "1" if event == Event.PROGRESS else "",
                    MAX_EVENTS_PER_REQUEST - 3)
    except redis.RedisError as exc:
        log.warning("webhook: cannot queue event %s: %s", eid, exc)


def emit_failure(client: redis.Redis, kwargs: dict, task_id: str, replica: str | None, exc: BaseException) -> None:
    """Queue the `failed` event of a request that failed for good, if it names a webhook that passes the checks
    (a request may fail before its validation: cancelled or poison)."""
    if not available():
        return
    try:
        webhook = check_webhook(kwargs.get("webhook"), kwargs.get("webhook_events"), policy=True,
                                tenant=kwargs.get("tenant"))
    except InvalidRequest:  # the webhook itself (or its tenant) was what failed it, or may not be reached
        return
    request_id = kwargs.get("request_id")
    emit(client, webhook, Event.FAILED, task_id=task_id,
         request_id=request_id if isinstance(request_id, str) else task_id, replica=replica,
         error=Failure(type=type(exc).__name__, message=str(exc)[:MAX_ERROR_CHARS]))


def destination(url: str) -> str:
    """The host:port that `url` reaches (lower case; the scheme's port if none): the unit of isolation."""
    parts = urllib.parse.urlsplit(url)
    return f"{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"


def tenant_secret(deployment_secret: str, tenant: str) -> str:
    """The secret that signs `tenant`'s events: hex HMAC-SHA256, keyed by the deployment's secret, of
    TENANT_SECRET_CONTEXT + tenant. One tenant's secret tells nothing of another's, nor of the deployment's."""
    check_tenant(tenant)
    return hmac.new(deployment_secret.encode(), (TENANT_SECRET_CONTEXT + tenant).encode(), hashlib.sha256).hexdigest()


def signature(secret: str, timestamp: int, body: bytes) -> str:
    """The v1 signature: hex HMAC-SHA256, keyed by the secret, of `<timestamp>.<body>`."""
    return hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()


class Outcome(StrEnum):
    DELIVERED = "delivered"  # 2xx
    RETRY = "retry"  # no answer, 429 or 5xx, or the host did not resolve: try again later
    FINAL = "final"  # any other answer, or the address is not allowed: not tried again


class _NotSent(Exception):
    """Raised when an attempt reached no receiver; `outcome` says whether a later one may."""

    def __init__(self, why: str, outcome: Outcome):
        super().__init__(why)
        self.outcome = outcome


def post(url: str, body: bytes, headers: dict, allow_nets) -> tuple[Outcome, str]:
    """One attempt: POST `body` to `url`, connecting only to an address checked now (the host's addresses may
    have changed since the request was validated). (outcome, what happened)."""
    try:
        to = fetch.target(url, allow_nets, lambda why: _NotSent(why, Outcome.FINAL),
                          unresolved=lambda why: _NotSent(why, Outcome.RETRY))
        status = _exchange(to, body, headers)
    except _NotSent as exc:
        return exc.outcome, str(exc)
    except Exception as exc:  # whatever the remote side did: refused, reset, timed out, TLS, not HTTP
        return Outcome.RETRY, f"no valid HTTP answer ({exc!r})"
    if 200 <= status < 300:
        return Outcome.DELIVERED, f"HTTP status {status}"
    return (Outcome.RETRY if status == 429 or status >= 500 else Outcome.FINAL), f"HTTP status {status}"


def _exchange(to: fetch.Target, body: bytes, headers: dict) -> int:
    """The answer's status to a POST of `body`, once connected within SEND_TIMEOUT_S in all."""
    sock = _connect(to.infos)
    guard = sock.dup()  # shut down at the deadline, which stops the exchange even once wrapped in TLS
    deadline = threading.Timer(SEND_TIMEOUT_S, fetch.shut, (guard,))
    deadline.start()
    try:
        if to.parts.scheme == "https":  # verified against the URL's host name, not looked up again
            sock = ssl.create_default_context().wrap_socket(sock, server_hostname=to.ascii_host)
        conn = http.client.HTTPConnection(to.ascii_host, to.port)
        conn.sock = sock  # connected to the checked address: http.client must not connect by itself
        conn.request("POST", to.path, body=body, headers={
            "Host": to.host_header, "User-Agent": "replicadp", "Content-Type": "application/json",
            "Connection": "close", **headers})
        return conn.getresponse().status
    finally:
        deadline.cancel()
        guard.close()
        sock.close()


def _connect(infos) -> socket.socket:
    """A socket connected to one of the checked addresses."""
    error = None
    for family, type_, proto, _, sockaddr in infos:
        sock = socket.socket(family, type_, proto)
        sock.settimeout(CONNECT_TIMEOUT_S)
        try:
            sock.connect(sockaddr)
            sock.settimeout(SEND_TIMEOUT_S)
            return sock
        except OSError as exc:
            error = exc
            sock.close()
    raise error


def backoff(attempts: int) -> float:
    """Seconds before the next attempt, after `attempts` failed ones."""
    return min(MAX_DELAY_S, BASE_DELAY_S * 2 ** (attempts - 1))


class Sender:
    """In a replica's main process: SENDERS threads that take due events and send them."""

    def __init__(self, url: str, secret: str, allow_nets: tuple, claim_s: int):
        self.redis = connection.client(url, socket_timeout=2, socket_connect_timeout=2)
        self.secret, self.allow_nets, self.claim_s = secret, allow_nets, claim_s

    def start(self) -> None:
        for n in range(SENDERS):
            threading.Thread(target=self.run, name=f"replicadp-webhook-{n}", daemon=True).start()

    def run(self) -> None:
        failing = False
        while True:
            try:
                claimed = self.redis.eval(_CLAIM, 5, WEBHOOK_DUE_KEY, WEBHOOK_EVENTS_KEY, WEBHOOK_ATTEMPTS_KEY,
                                          WEBHOOK_BACKOFF_KEY, STATS_KEY, self.claim_s, PER_HOST_SENDS, SCAN,
                                          WEBHOOK_SENDING_KEY, POLL_S, ATTEMPTS)
                failing = False
            except redis.RedisError as exc:
                if not failing:  # once per outage
                    log.warning("webhook: cannot reach Redis (%s); sending resumes when it is back", exc)
                failing = True
                claimed = None
            if claimed is None:
                time.sleep(POLL_S)
                continue
            try:
                self.send(claimed[0].decode(), json.loads(claimed[1]), int(claimed[2]))
            except Exception:  # never let a sender die with a bug in one event; it is due again after claim_s
                log.exception("webhook: sending failed")

    def send(self, eid: str, queued: Queued, attempt: int) -> None:
        """Attempt `attempt` (1-based) at a taken event, and what follows: done, due again later, or given up."""
        body = json.dumps(queued["payload"], separators=(",", ":")).encode()
        tenant = queued.get("tenant")
        secret = self.secret if tenant is None else tenant_secret(self.secret, tenant)
        now = int(time.time())
        outcome, why = post(queued["url"], body, {
            EVENT_ID_HEADER: eid, EVENT_HEADER: queued["payload"]["event"],
            SIGNATURE_HEADER: f"t={now},v1={signature(secret, now, body)}"}, self.allow_nets)
        progress = queued["payload"]["event"] == Event.PROGRESS
        retry = outcome == Outcome.RETRY and not progress and attempt < ATTEMPTS  # progress: one attempt only
        counter = "" if outcome == Outcome.DELIVERED or retry else (
            "webhook_progress_dropped" if progress else "webhook_give_ups")
        dest = queued.get("dest") or destination(queued["url"])
        self.redis.eval(_DONE, 6, WEBHOOK_DUE_KEY, WEBHOOK_EVENTS_KEY, WEBHOOK_ATTEMPTS_KEY, STATS_KEY,
                        WEBHOOK_BACKOFF_KEY, WEBHOOK_FAILS_KEY, eid, attempt, dest, WEBHOOK_SENDING_KEY,
                        "1" if outcome == Outcome.RETRY else "", backoff(attempt) if retry else "", counter,
                        HOST_BASE_DELAY_S, MAX_HOST_DELAY_S)
        if counter:
            # The host only: a URL's path or query may hold the receiver's token.
            log.warning("webhook: gave up on event %s to %s after %d attempt(s): %s", eid, dest, attempt, why)
