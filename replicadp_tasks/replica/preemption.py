"""The preemption policy (REPLICADP_PREEMPT_AFTER_S): when a request of a higher priority waits for a model whose
replicas are all busy with lower-priority work that will not end soon, the replica whose request has the most time
left stops it at its next step (replica/delivery.py saves its state; it goes back to the head of its priority
list and goes on from that step later). Each replica's main process looks every LOOK_S (`Preemptor`), and only
the replica whose request is chosen asks (cluster/preempt.py): every replica of a model reads the same figures
and chooses the same one. One preemption per waiting request: the replica that preempts claims the waiting
request it frees a replica for, so that two requests waiting at once get two replicas at once, and a look made
while a stopped request is requeued (and its replica about to take the waiting one) preempts nothing more.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

import redis

from ..broker import waiting
from ..cluster import connection, heartbeat, preempt
from ..contract.keys import PREEMPT_KEY, PREEMPTIONS_KEY, REPLICA_KEY
from ..contract.records import Phase
from ..contract.scheduling import Priority

log = logging.getLogger("replicadp")

# + a waiting request's task id: the task id of the request preempted to free a replica for it.
CLAIM_KEY = "replicadp:preempted-for:"
# A claim lasts as long as the ask it goes with (an ask of a request that does not stop lapses then): past it, a
# request still waiting may be given another preemption.
CLAIM_S = preempt.ASK_S
# How often a replica looks: what a waiting request may wait for a look, on top of a step (the bench's interactive
# waits: docs/benchmarks.md, section 18); a look is four reads.
LOOK_S = 0.5
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


def choose(waiting: list[tuple[Priority, str]], busy: list[Busy], idle: int, after_s: float, max_preemptions: int,
           freeing: frozenset[str] = frozenset()) -> tuple[Busy, str] | None:
    """The request to preempt, and the task id of the waiting request it is preempted for, or None. `waiting`:
    the requests waiting for the model with no preemption made for them yet (their priority and task id, in the
    order replicas take them). The first of them are left to the `idle` replicas and to those expected free
    within `after_s` (past their steps, or with no more than that left, or asked to stop with no waiting request
    named: `freeing`, the task ids of those asked by hand); for the next, of the requests of a lower priority not
    yet asked to stop, preempted fewer than `max_preemptions` times, with more than `after_s` left: the one
    preempted the fewest times, then with the most time left (a request just resumed would otherwise be stopped
    again at once, spending its preemptions while the others spend none)."""
    soon = sum(1 for b in busy if (b.left_s is not None and b.left_s <= after_s) or b.task_id in freeing)
    if len(waiting) <= idle + soon:
        return None
    priority, task_id = waiting[idle + soon]
    candidates = [b for b in busy if not b.asked and rank(b.priority) > rank(priority)
                  and b.preemptions < max_preemptions and b.left_s is not None and b.left_s > after_s]
    chosen = max(candidates, key=lambda b: (-b.preemptions, b.left_s), default=None)
    return None if chosen is None else (chosen, task_id)


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
        mine = self.of_model(beats.serving)
        unclaimed, victims = self.waiting(len(mine))
        if not unclaimed or rank(unclaimed[0][0]) >= rank(Priority(beats.running[self.name]["priority"])):
            return
        busy = self.busy({name: beats.running[name] for name in mine if name in beats.running})
        chosen = choose(unclaimed, busy, idle=len([n for n in mine if n not in beats.running]),
                        after_s=self.after_s, max_preemptions=self.max_preemptions,
                        freeing=frozenset(b.task_id for b in busy if b.asked and b.task_id not in victims))
        if chosen is None or chosen[0].replica != self.name:
            return
        victim, waiting_id = chosen
        if self.redis.set(CLAIM_KEY + waiting_id, victim.task_id, nx=True, ex=CLAIM_S):
            log.info("preemption: request %s (%s, about %.0f s left) stops at its next step for request %s of %s, "
                     "waiting", victim.task_id, victim.priority, victim.left_s, waiting_id, self.model)
            preempt.ask(self.redis, victim.task_id)

    def waiting(self, first: int) -> tuple[list[tuple[Priority, str]], set[str]]:
        """The requests waiting for this model with no preemption made for them, in the order replicas take them
        (of each priority's list, the first `first`: no more can be given a replica), and the task ids of the
        requests preempted for the others."""
        queued = [(level, task_id) for level, task_id in waiting(self.redis, self.queue, first) if task_id]
        claims = self.redis.mget([CLAIM_KEY + task_id for _, task_id in queued]) if queued else []
        return ([w for w, claim in zip(queued, claims) if claim is None],
                {claim.decode() for claim in claims if claim is not None})

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
