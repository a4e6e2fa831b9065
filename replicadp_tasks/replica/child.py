"""The pool child: the process that runs `generate`. What it holds (the resident pipeline, the output store, its
Redis clients) and the records it keeps in Redis. Set once, by worker.py, after the model has loaded. It
connects no signal and adds no bootstep (worker.py does), so producers import tasks.py without side effects.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass

from redis import Redis

from ..broker.transport import record_dead
from ..cluster import fence
from ..contract.errors import PoisonRequest, RequestCancelled
from ..contract.keys import (ATTEMPTS_KEY, CANCEL_KEY, CHECKPOINT_KEY, COMPLETED_KEY, PREEMPT_KEY, UNACKED_INDEX_KEY,
                             UNACKED_KEY, FenceToken, completed_key)
from ..contract.records import RequestState
from ..model.pipeline import PipelineHolder
from ..settings import SETTINGS
from .fences import FenceKeeper
from .finisher import Finisher
from .outcomes import Exit, Finishing, exit_process
from .reporter import Reporter


@dataclass
class PoolChild:
    pipeline: PipelineHolder  # loaded: the model stays resident between requests
    store: object  # DirStore, RedisStore or S3Store (outputs/store.py)
    redis: Redis  # rides out a Redis restart (connection.outage_tolerant)
    fences: FenceKeeper  # keeps the fences of its requests and hears their cancels, from a thread
    reporter: Reporter  # writes its progress records, from a thread
    finisher: Finisher  # encodes, stores and answers a request while the next is computed, from a thread

    def check_group(self, task_id: str) -> None:
        """End this process, before request `task_id` is counted, if its ranks must form their group again (an
        out of memory on one of them left them apart): the request is requeued and the next child rebuilds it."""
        if self.pipeline.group_broken is not None:
            exit_process(Exit.GROUP_LOST, f"request {task_id}: the replica's ranks must form their group again "
                                          f"({self.pipeline.group_broken})")

    @contextmanager
    def reporting(self, request):
        """Around a request's run here: its STARTED record (the pid and the replica) queued for the reporter
        thread at the start, and every record it queued written before Celery writes its answer; not when the
        finisher answers it (Finishing: the finisher flushes before it answers)."""
        self.reporter.put(request.id, RequestState.STARTED, {"pid": os.getpid(), "hostname": request.hostname},
                          request)
        try:
            yield
        except Finishing:
            raise
        except BaseException:
            self.reporter.flush()
            raise
        self.reporter.flush()

    def cancelled(self, task_id: str) -> bool:
        return bool(self.redis.exists(CANCEL_KEY + task_id))

    def start_attempt(self, task_id: str, kwargs: dict) -> dict:
        """Count one more start of this task (redeliveries keep the task id), and look for its cancel, for where a
        preemption stopped it and for a preemption asked before it started, in one round trip. RequestCancelled if
        it was cancelled before it started; PoisonRequest (recorded dead) if each of its REPLICADP_MAX_ATTEMPTS
        earlier starts ended its replica's process. Returns its checkpoint's hash as saved (empty: none;
        Delivery.checkpoint reads it); a preemption asked makes its steps ask Redis (FenceKeeper.hear), however
        soon it is to stop."""
        request_id = kwargs.get("request_id")
        checkpoint = CHECKPOINT_KEY + (request_id if isinstance(request_id, str) else task_id)
        pipe = self.redis.pipeline()
        pipe.incr(ATTEMPTS_KEY + task_id)
        pipe.expire(ATTEMPTS_KEY + task_id, SETTINGS.result_ttl_s)
        pipe.exists(CANCEL_KEY + task_id)
        pipe.hgetall(checkpoint)
        pipe.exists(PREEMPT_KEY + task_id)
        attempt, _, cancelled, saved, asked = pipe.execute()
        if cancelled:
            if saved:  # nobody will go on from where a preemption stopped it
                self.redis.delete(checkpoint)
            raise RequestCancelled(f"request {task_id} was cancelled before it started")
        if asked:
            self.fences.hear(task_id)
        if attempt > SETTINGS.max_attempts:
            record_dead(self.redis, {"task_id": task_id, "reason": f"poison: ended its replica's process "
                                     f"{attempt - 1} times", "kwargs": kwargs, "attempts": attempt - 1})
            raise PoisonRequest(f"request {task_id} ended its replica's process {attempt - 1} times; not retried "
                                f"again (REPLICADP_MAX_ATTEMPTS={SETTINGS.max_attempts})")
        return saved

    def uncount_attempt(self, task_id: str) -> None:
        """Take back the count of this start: it ends cleanly, parked (Delivery.take_fence)."""
        self.redis.decr(ATTEMPTS_KEY + task_id)

    def record_completion(self, request_id: str, task_id: str, fence_key: str, tok: FenceToken) -> bool:
        """Count a request stored and release its fence, unless its task was cancelled meanwhile (the same round
        trip); returns whether it was. The fence keeper stops keeping the fence first: none of its renewals follows
        the release (the main process keeps it until the child acknowledges the message)."""
        self.fences.unwatch(tok)
        now = time.time()
        pipe = self.redis.pipeline()
        for completed in (COMPLETED_KEY, completed_key(SETTINGS.served_model_name)):
            pipe.zadd(completed, {request_id: now})
            pipe.zremrangebyscore(completed, 0, now - 3600)
        pipe.delete(CHECKPOINT_KEY + request_id)  # where it was preempted, if it was: done with
        fence.release_unless(pipe, fence_key, tok, CANCEL_KEY + task_id)
        return not pipe.execute()[-1]

    def acknowledge(self, delivery_tag: str) -> None:
        """Acknowledge a message as its replica's main process would (kombu's `unacked` and its index), for a
        request that the finisher answered (outcomes.Finishing). The main process's lease thread then forgets it."""
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
