"""Writes that survive a Redis failover (docs/reliability.md, "Redis failover"): replication is asynchronous, so
a write the old master acknowledged can be missing on the one Sentinel promotes. Where a guarantee rests on a
write (a queued request, a fence, a result, a cancel), the writer makes it until replicas hold it: `durable()`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

import redis
from redis.sentinel import SentinelConnectionPool

from ..contract.errors import ReplicaDPError
from ..contract.keys import REPLICATED_KEY
from . import connection

log = logging.getLogger("replicadp")
T = TypeVar("T")


class NotReplicated(ReplicaDPError, redis.ConnectionError):
    """Raised when a write that a guarantee rests on (a queued request, a fence, a result, a cancel) was written
    again and again and no Redis replica acknowledged it (REPLICADP_REDIS_REPLICAS) for as long as its writer waits
    out an outage: a failover could lose it, so it is not reported done.

    A redis ConnectionError: a producer's request is not accepted (Celery's publish retries it, then the caller
    gets the error); in a replica it fails the request.
    """


def replicated(r: redis.Redis, replicas: int, timeout_ms: int, what: str) -> bool:
    """Wait until `replicas` replicas hold every write the master has acknowledged so far (a mark written here,
    then WAIT on the same connection), and, with Sentinel, check that the server is still the master Sentinel
    names; False, logged, when fewer had it within `timeout_ms` or it is not. `what`: the write waited for, for
    the log."""
    if replicas <= 0:
        return True
    retry = r.get_retry()  # the client's (outage_tolerant's waits out an outage), if it has one
    acked, server = (retry.call_with_retry(lambda: _wait(r, replicas, timeout_ms), lambda error: None) if retry
                     else _wait(r, replicas, timeout_ms))
    if acked < replicas:
        log.warning("%s: %d of %d Redis replica(s) acknowledged it within %d ms", what, acked, replicas, timeout_ms)
        return False
    # A stopped master that resumes after Sentinel promoted another can get a replica back for a moment (one that
    # Sentinel has not moved to the new master yet), which acknowledges, and then resyncs from the new master.
    pool = r.connection_pool
    if isinstance(pool, SentinelConnectionPool):
        master = connection.newest_master(pool.sentinel_manager.sentinels, pool.service_name)
        if master != server:
            log.warning("%s: written to %s:%d, which is not the master Sentinel names (%s)", what, *server,
                        master or "none: a failover is under way, or no Sentinel answered")
            return False
    return True


def _wait(r: redis.Redis, replicas: int, timeout_ms: int) -> tuple[int, tuple[str, int]]:
    """(replicas that acknowledged, the server's address), on one connection: WAIT counts the writes of its own
    connection, and replication is in order, so the mark acknowledged means every earlier write is too."""
    conn = r.connection_pool.get_connection()
    try:
        conn.send_command("INCR", REPLICATED_KEY)
        conn.read_response()
        conn.send_command("WAIT", replicas, timeout_ms)
        return conn.read_response(), (str(conn.host), int(conn.port))
    except (redis.ConnectionError, redis.TimeoutError):
        conn.disconnect()
        raise
    finally:
        r.connection_pool.release(conn)


@dataclass(frozen=True)
class Durability:
    """How writes that a guarantee rests on are kept across a failover: how many Redis replicas must hold each
    (REPLICADP_REDIS_REPLICAS: 0, nothing to wait for), how long one may take to say so
    (REPLICADP_REDIS_ACK_TIMEOUT_MS), and how long a writer keeps trying (REPLICADP_REDIS_OUTAGE). settings.py
    makes it (Settings.durability)."""

    replicas: int
    ack_timeout_ms: int
    give_up_s: float


def durable(r: redis.Redis, write: Callable[[], T], what: str, policy: Durability,
            give_up_s: float | None = None) -> T:
    """`write()` (which must be safe to repeat), then wait for `policy.replicas` replicas to hold it; returns what
    the last `write()` returned. `what`: the write, for the log and the error. Not acknowledged in
    `policy.ack_timeout_ms`, or acknowledged by a server Sentinel no longer names the master, the write may have
    gone to a master that Sentinel has since replaced (a stopped one that resumed, and still counts its replicas for
    up to a second): the connections are dropped, so the next ones ask Sentinel, and the write is made again, until
    `give_up_s` (the policy's when None) have passed: then NotReplicated."""
    give_up_s = policy.give_up_s if give_up_s is None else give_up_s
    deadline = time.monotonic() + give_up_s
    while True:
        answer = write()
        if replicated(r, policy.replicas, policy.ack_timeout_ms, what):
            return answer
        if time.monotonic() > deadline:
            raise NotReplicated(f"{what}: no Redis replica acknowledged it in {give_up_s:g} s of trying "
                                f"(REPLICADP_REDIS_REPLICAS={policy.replicas})")
        r.connection_pool.disconnect()
