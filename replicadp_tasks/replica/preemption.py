"""The preemption policy (REPLICADP_PREEMPT_AFTER_S): when a request of a higher priority waits for a model whose
replicas are all busy with lower-priority work that will not end soon, the replica whose request has the most time
left stops it at its next step (replica/delivery.py saves its state; it goes back to the head of its priority
list and goes on from that step later). Each replica's main process looks every LOOK_S (`Preemptor`), and only
the replica whose request is chosen asks (cluster/preempt.py): every replica of a model reads the same figures
and chooses the same one; a claim per model keeps two looks a moment apart from preempting twice for one wait.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

import redis

from ..cluster import connection, heartbeat, preempt
from ..contract.keys import PREEMPT_KEY, PREEMPTIONS_KEY, REPLICA_KEY
from ..contract.records import Phase
from ..contract.scheduling import Priority, queue_lists

log = logging.getLogger("replicadp")

CLAIM_KEY = "replicadp:preempting:"  # + model: set for a moment by the replica that preempts for it
# How often a replica looks: what a waiting request may wait for a look, on top of a step (the bench's interactive
# waits: docs/benchmarks.md, section 18); a look is three reads.
LOOK_S = 0.5
# Two replicas' looks in the same instant: the freed replica takes the waiting request, and its heartbeat says so
# (within 0.1 s), before the look after next.
CLAIM_S = 2 * LOOK_S
TASK_META = "celery-task-meta-"  # + task id: Celery's result record, a running request's Progress


@dataclass(frozen=True)
class Busy:
    """A replica of the model and the request it runs, as the policy weighs it."""

    replica: str
    task_id: str
    priority: Priority
    left_s: float | None  # its denoising steps' time left, estimated; None: not denoising (yet, or any more)
    preemptions: int  # how often it was preempted already
    asked: bool  # a preemption of it is asked for already


def rank(priority: Priority) -> int:
    """0 for the highest priority."""
    return list(Priority).index(priority)


def choose(waiting: Priority | None, busy: list[Busy], idle: int, after_s: float, max_preemptions: int) -> Busy | None:
    """The request to preempt for the highest-priority request `waiting` (None: nothing waits), or None: none when
    a replica of the model is `idle` or a preemption is asked already (the waiting request is about to be taken),
    or a busy replica is expected free within `after_s` (past its steps, or with no more than that left); else,
    of the requests of a lower priority preempted fewer than `max_preemptions` times with more than `after_s`
    left, the one preempted the fewest times, then with the most time left: a request just resumed would
    otherwise be stopped again at once, spending its preemptions while the others spend none."""
    if waiting is None or idle or any(b.asked for b in busy):
        return None
    if any(b.left_s is not None and b.left_s <= after_s for b in busy):
        return None
    candidates = [b for b in busy if rank(b.priority) > rank(waiting) and b.preemptions < max_preemptions
                  and b.left_s is not None and b.left_s > after_s]
    return max(candidates, key=lambda b: (-b.preemptions, b.left_s), default=None)


def left_s(progress: dict | None, now: float) -> float | None:
    """A denoising request's steps' time left, from its Progress (replica/delivery.py): the time per step since
    its denoising phase began, times the steps left. The phase begins as its first step (since it (re)started)
    ends, so the steps timed are those after it; right after that first step, the time since it stands for one
    step (a low guess at first, soon a better one). None before its first step and past its last."""
    if not isinstance(progress, dict) or progress.get("phase") != Phase.DENOISING:
        return None
    done = progress["step"] - progress.get("first_step", 0)
    if done < 1:
        return None
    return (now - progress["phase_started_at"]) / max(done - 1, 1) * (progress["total_steps"] - progress["step"])


class Preemptor:
    """In a replica's main process: `run()` looks every LOOK_S, from a thread, whether to preempt the request
    this replica runs (`choose`), for its model `model` (queue `queue`)."""

    def __init__(self, name: str, url: str, model: str, queue: str, after_s: float, max_preemptions: int,
                 stale_s: float):
        self.name, self.model, self.queue = name, model, queue
        self.after_s, self.max_preemptions, self.stale_s = after_s, max_preemptions, stale_s
        self.redis = connection.client(url, socket_timeout=2, socket_connect_timeout=2)

    def run(self) -> None:
        while True:
            started = time.monotonic()
            try:
                self.look()
            except redis.RedisError as exc:
                log.debug("preemption: cannot look now: %s", exc)
            except Exception:  # never let the thread die with a bug in one look
                log.exception("preemption: look failed")
            time.sleep(max(0.0, LOOK_S - (time.monotonic() - started)))

    def look(self) -> None:
        """One look: what waits, what runs; preempt this replica's request if it is the one chosen."""
        beats = heartbeat.read(self.redis, self.stale_s)
        if self.name not in beats.running:
            return  # only the replica whose request is chosen asks: this one runs nothing
        waiting = self.waiting()
        if waiting is None or rank(waiting) >= rank(Priority(beats.running[self.name]["priority"])):
            return
        mine = self.of_model(beats.serving)
        busy = self.busy({name: beats.running[name] for name in mine if name in beats.running})
        chosen = choose(waiting, busy, idle=len([n for n in mine if n not in beats.running]),
                        after_s=self.after_s, max_preemptions=self.max_preemptions)
        if chosen is None or chosen.replica != self.name:
            return
        if self.redis.set(CLAIM_KEY + self.model, self.name, nx=True, px=int(CLAIM_S * 1000)):
            log.info("preemption: request %s (%s, about %.0f s left) stops at its next step for a waiting %s "
                     "request of %s", chosen.task_id, chosen.priority, chosen.left_s, waiting, self.model)
            preempt.ask(self.redis, chosen.task_id)

    def waiting(self) -> Priority | None:
        """The highest priority of a request waiting in this model's queue, or None."""
        lists = queue_lists(self.queue)
        pipe = self.redis.pipeline(transaction=False)
        for name in lists:
            pipe.llen(name)
        return next((level for level, n in zip(Priority, pipe.execute()) if n), None)

    def of_model(self, serving: list[str]) -> list[str]:
        """The serving replicas of this replica's model."""
        infos = self.redis.mget([REPLICA_KEY + name for name in serving]) if serving else []
        return [name for name, info in zip(serving, infos) if info and json.loads(info).get("model") == self.model]

    def busy(self, running: dict[str, dict]) -> list[Busy]:
        """Each running replica of the model with its request's priority, time left and preemptions."""
        names = list(running)
        pipe = self.redis.pipeline(transaction=False)
        for name in names:
            task_id = running[name]["task_id"]
            pipe.get(TASK_META + task_id)
            pipe.get(PREEMPTIONS_KEY + task_id)
            pipe.exists(PREEMPT_KEY + task_id)
        replies, now = pipe.execute(), time.time()
        out = []
        for i, name in enumerate(names):
            meta, count, asked = replies[3 * i:3 * i + 3]
            progress = json.loads(meta).get("result") if meta else None
            out.append(Busy(name, running[name]["task_id"], Priority(running[name].get("priority", "normal")),
                            left_s(progress, now), int(count or 0), bool(asked)))
        return out
