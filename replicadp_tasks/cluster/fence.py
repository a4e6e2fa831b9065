"""The fence: `replicadp:lock:<request_id>` holds the FenceToken (keys.py) of the one delivery that may compute a
request, for a lease of REPLICADP_LEASE seconds, renewed while it computes. Who takes, renews and releases it, and
why, is told in replica/leases.py; here are the atomic operations on it (Lua beside this module)."""

from __future__ import annotations

from enum import StrEnum
from typing import NamedTuple

import redis

from ..contract.keys import FenceToken
from .scripts import lua

TICK_S = 1.0  # the fence's and the leases' renewal period: a lease of 6 s survives 5 missed ticks

ACQUIRE = lua(__package__, "fence_acquire")
RENEW = lua(__package__, "fence_renew")
RELEASE = lua(__package__, "fence_release")
RELEASE_UNLESS = lua(__package__, "fence_release_unless")


class FenceState(StrEnum):
    ACQUIRED = "acquired"  # it was free (or had expired): taken now
    HELD = "held"  # this delivery held it already: renewed
    TAKEN = "taken"  # another delivery holds it (`owner` says which)
    CANCELLED = "cancelled"  # the request was cancelled (acquire_unless only): not taken


class FenceAnswer(NamedTuple):
    state: FenceState
    owner: str | None = None  # the other delivery's token, when TAKEN

    @property
    def ours(self) -> bool:
        return self.state in (FenceState.ACQUIRED, FenceState.HELD)


def _answer(reply: bytes) -> FenceAnswer:
    reply = reply.decode()
    if reply in (FenceState.ACQUIRED, FenceState.HELD):
        return FenceAnswer(FenceState(reply))
    return FenceAnswer(FenceState.TAKEN, reply)


def acquire(r: redis.Redis, key: str, tok: FenceToken, lease_s: int) -> FenceAnswer:
    """Take the fence for this delivery, or renew it if this delivery holds it; else say who holds it."""
    return _answer(r.eval(ACQUIRE, 1, key, str(tok), lease_s * 1000))


def acquire_unless(r: redis.Redis, key: str, tok: FenceToken, lease_s: int, cancel_key: str) -> FenceAnswer:
    """CANCELLED if `cancel_key` exists, else what acquire() answers. One round trip."""
    pipe = r.pipeline(transaction=False)
    pipe.exists(cancel_key)
    pipe.eval(ACQUIRE, 1, key, str(tok), lease_s * 1000)
    cancelled, reply = pipe.execute()
    return FenceAnswer(FenceState.CANCELLED) if cancelled else _answer(reply)


def renew(pipe, key: str, tok: FenceToken, lease_s: int) -> None:
    """Queue on `pipe`: renew the fence if `tok` holds it. Its reply: 1 if renewed, else 0."""
    pipe.eval(RENEW, 1, key, str(tok), lease_s * 1000)


def release(r, key: str, tok: FenceToken) -> None:
    """Release the fence if `tok` holds it (on a client, or queued on a pipeline)."""
    r.eval(RELEASE, 1, key, str(tok))


def release_unless(pipe, key: str, tok: FenceToken, cancel_key: str) -> None:
    """Queue on `pipe`: release the fence unless `cancel_key` exists (a cancelled request keeps its fence until
    its stored video is removed). Its reply: 1 if not cancelled, else 0."""
    pipe.eval(RELEASE_UNLESS, 2, key, cancel_key, str(tok))
