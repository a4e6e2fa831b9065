"""The pool child: the process that runs `generate`. What it holds (the resident pipeline, the output store, its
Redis clients) and the records it keeps in Redis. Set once, by worker.py, after the model has loaded. It
connects no signal and adds no bootstep (worker.py does), so producers import tasks.py without side effects.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from redis import Redis

from .finisher import Finisher
from ..contract.keys import ATTEMPTS_KEY, CANCEL_KEY, COMPLETED_KEY, UNACKED_INDEX_KEY, UNACKED_KEY, FenceToken
from ..cluster.lease import FenceKeeper, release_unless
from ..model.pipeline import PipelineHolder
from .reporter import Reporter
from ..settings import SETTINGS
from ..broker.transport import record_dead


@dataclass
class PoolChild:
    pipeline: PipelineHolder  # loaded: the model stays resident between requests
    store: object  # DirStore or RedisStore (store.py)
    redis: Redis  # rides out a Redis restart (store.outage_tolerant)
    fences: FenceKeeper  # keeps the fences of its requests and hears their cancels, from a thread
    reporter: Reporter  # writes its progress records, from a thread
    finisher: Finisher  # encodes, stores and answers a request while the next is computed, from a thread

    def cancelled(self, task_id: str) -> bool:
        return bool(self.redis.exists(CANCEL_KEY + task_id))

    def start_attempt(self, task_id: str) -> tuple[int, bool]:
        """Count one more start of this task (redeliveries keep the task id); returns the count, and whether the
        task was cancelled (the same round trip)."""
        pipe = self.redis.pipeline()
        pipe.incr(ATTEMPTS_KEY + task_id)
        pipe.expire(ATTEMPTS_KEY + task_id, SETTINGS.result_ttl_s)
        pipe.exists(CANCEL_KEY + task_id)
        attempt, _, cancelled = pipe.execute()
        return attempt, bool(cancelled)

    def uncount_attempt(self, task_id: str) -> None:
        """Take back the count of this start: it ends cleanly, parked (tasks.Delivery.take_fence)."""
        self.redis.decr(ATTEMPTS_KEY + task_id)

    def record_poison(self, task_id: str, kwargs: dict, attempts: int) -> None:
        record_dead(self.redis, {"task_id": task_id, "reason": f"poison: ended its replica's process {attempts} "
                                 "times", "kwargs": kwargs, "attempts": attempts})

    def record_completion(self, request_id: str, task_id: str, fence: str, tok: FenceToken) -> bool:
        """Count a request stored and release its fence, unless its task was cancelled meanwhile (the same round
        trip); returns whether it was."""
        now = time.time()
        pipe = self.redis.pipeline()
        pipe.zadd(COMPLETED_KEY, {request_id: now})
        pipe.zremrangebyscore(COMPLETED_KEY, 0, now - 3600)
        release_unless(pipe, fence, tok, CANCEL_KEY + task_id)
        return not pipe.execute()[2]

    def acknowledge(self, delivery_tag: str) -> None:
        """Acknowledge a message as its replica's main process would (kombu's `unacked` and its index), for a
        request that the finisher answered (errors.Finishing). The main process's lease thread then forgets it."""
        pipe = self.redis.pipeline()
        pipe.zrem(UNACKED_INDEX_KEY, delivery_tag)
        pipe.hdel(UNACKED_KEY, delivery_tag)
        pipe.execute()


_child: PoolChild | None = None


def current() -> PoolChild:
    """This pool child's state; raises outside a replica's pool child (nothing loaded there)."""
    if _child is None:
        raise RuntimeError("no pipeline loaded: generate runs only in a replica's pool child")
    return _child


def become(child: PoolChild) -> None:
    """In a replica's pool child, once its model has loaded (worker.py)."""
    global _child
    _child = child
