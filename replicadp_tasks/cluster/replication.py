"""Writes that survive a Redis failover (docs/reliability.md, "Redis failover"): replication is asynchronous, so
a write the old master acknowledged can be missing on the one Sentinel promotes. Where a guarantee rests on a
write (a queued request, a fence, a result, a cancel), the writer makes it until replicas hold it: `durable()`.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, TypeVar

import redis
from redis.sentinel import SentinelConnectionPool

from . import connection
from ..contract.errors import NotReplicated
from ..contract.keys import REPLICATED_KEY
from ..settings import SETTINGS

log = logging.getLogger("replicadp")
T = TypeVar("T")


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


def durable(r: redis.Redis, write: Callable[[], T], what: str, give_up_s: float | None = None) -> T:
    """`write()` (which must be safe to repeat), then wait for REPLICADP_REDIS_REPLICAS replicas to hold it;
    returns what the last `write()` returned. `what`: the write, for the log and the error. Not acknowledged in
    REPLICADP_REDIS_ACK_TIMEOUT_MS, or acknowledged by a server Sentinel no longer names the master, the write
    may have gone to a master that Sentinel has since replaced (a stopped one that resumed, and still counts its
    replicas for up to a second): the connections are dropped, so the next ones ask Sentinel, and the write is
    made again, until `give_up_s` (REPLICADP_REDIS_OUTAGE when None) have passed: then NotReplicated."""
    replicas, timeout_ms = SETTINGS.redis_replicas, SETTINGS.redis_ack_timeout_ms
    give_up_s = SETTINGS.redis_outage_s if give_up_s is None else give_up_s
    deadline = time.monotonic() + give_up_s
    while True:
        answer = write()
        if replicated(r, replicas, timeout_ms, what):
            return answer
        if time.monotonic() > deadline:
            raise NotReplicated(f"{what}: no Redis replica acknowledged it in {give_up_s:g} s of trying "
                                f"(REPLICADP_REDIS_REPLICAS={replicas})")
        r.connection_pool.disconnect()
