"""The webhook senders: threads of every replica's main process that take the events that are due and POST them
(the room's story: webhooks/__init__.py)."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import ssl
import threading
import time
from enum import StrEnum

import redis

from ..cluster import connection
from ..cluster.scripts import lua
from ..contract.keys import (STATS_KEY, WEBHOOK_ATTEMPTS_KEY, WEBHOOK_BACKOFF_KEY, WEBHOOK_DUE_KEY,
                             WEBHOOK_EVENTS_KEY, WEBHOOK_FAILS_KEY, WEBHOOK_SENDING_KEY)
from ..contract.webhook import EVENT_HEADER, EVENT_ID_HEADER, SIGNATURE_HEADER, Event, signature, tenant_secret
from ..inputs import fetch
from .events import Queued, destination

log = logging.getLogger("replicadp")

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
SCAN = 100  # due events a claim looks through for one whose host is free: the others wait POLL_S
SENDERS = 2  # threads per replica: one receiver that times out does not hold back the events of the others
POLL_S = 0.5  # how often an idle sender looks for due events (a Redis script each time); a busy host's wait
CLAIM = lua(__package__, "claim")
DONE = lua(__package__, "done")


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
                claimed = self.redis.eval(CLAIM, 5, WEBHOOK_DUE_KEY, WEBHOOK_EVENTS_KEY, WEBHOOK_ATTEMPTS_KEY,
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
        self.redis.eval(DONE, 6, WEBHOOK_DUE_KEY, WEBHOOK_EVENTS_KEY, WEBHOOK_ATTEMPTS_KEY, STATS_KEY,
                        WEBHOOK_BACKOFF_KEY, WEBHOOK_FAILS_KEY, eid, attempt, dest, WEBHOOK_SENDING_KEY,
                        "1" if outcome == Outcome.RETRY else "", backoff(attempt) if retry else "", counter,
                        HOST_BASE_DELAY_S, MAX_HOST_DELAY_S)
        if counter:
            # The host only: a URL's path or query may hold the receiver's token.
            log.warning("webhook: gave up on event %s to %s after %d attempt(s): %s", eid, dest, attempt, why)
