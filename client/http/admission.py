"""Admission: the queue-depth limit (`--max-queue`), per model, shared by every gateway of one Redis.

A request is admitted while its model's queue (LLEN of every priority's list) plus the requests admitted for it and
not yet pushed onto it (a sorted set of reservations, any gateway's) is under the limit; its reservation counts it
until its send has pushed it. One Lua script checks and reserves, atomically across gateways: nothing waits for a
lock, and the one cost is counting a request twice between its push and its release (at worst a 429 a moment early,
never a queue over the limit). docs/http.md, "Backpressure".
"""

from __future__ import annotations

import math
import time
from contextlib import suppress

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from replicadp_tasks import app as celery_app
from replicadp_tasks.cluster import lua
from replicadp_tasks.contract import keys, queue_for, queue_lists

from .errors import ErrorCode, GatewayError

# A reservation older than this is dropped: its gateway died (or lost Redis) between admitting and sending. Above
# the ~30 s a send rides out a Redis restart for (celeryconfig's task_publish_retry_policy).
ADMIT_STALE_S = 60
THROUGHPUT_WINDOW_S = 300  # completions over this window estimate Retry-After
RETRY_AFTER_UNKNOWN_S = 10  # Retry-After when nothing completed lately (no rate to estimate from)

RESERVE = lua(__package__, "reserve")


class Admission:
    """Reservations against the limit, `limit` requests waiting in each model's queue."""

    def __init__(self, client: aioredis.Redis, limit: int, prefix: str):
        self.client, self.limit, self.prefix = client, limit, prefix
        self._reserve = client.register_script(RESERVE)

    async def reserve(self, task_id: str, model: str) -> None:
        """Count `task_id` against the limit of `model`'s queue until `release`; past the limit, raise the 429 with
        Retry-After."""
        queue = queue_for(self.prefix, model)
        admitted, depth = await self._reserve(keys=[keys.ADMITTING_KEY + queue, *queue_lists(queue)],
                                              args=[self.limit, task_id, ADMIT_STALE_S])
        if not admitted:
            wait = await self.retry_after(depth, model)
            raise GatewayError(429, f"{depth} requests are waiting for model {model!r} (the limit is {self.limit}); "
                                    f"retry in about {wait} s", code=ErrorCode.QUEUE_FULL,
                               headers={"Retry-After": str(wait)})

    def release(self, task_id: str, model: str) -> None:
        """Once `model`'s queue holds the request; called from the thread that sent it. A failed release leaves the
        reservation to expire after ADMIT_STALE_S."""
        with suppress(RedisError):
            celery_app.backend.client.zrem(keys.ADMITTING_KEY + queue_for(self.prefix, model), task_id)

    async def retry_after(self, depth: int, model: str) -> int:
        """Seconds until `model`'s queue is likely below the limit again: the requests past it over the model's
        completion rate of the last THROUGHPUT_WINDOW_S (every replica's, not only this gateway's)."""
        now = time.time()
        done = await self.client.zcount(keys.completed_key(model), now - THROUGHPUT_WINDOW_S, now)
        if not done:
            return RETRY_AFTER_UNKNOWN_S
        return max(1, math.ceil((depth - self.limit + 1) * THROUGHPUT_WINDOW_S / done))
