"""Leases: who holds which message, who is alive, and who may compute a request.

Redis redelivers an unacknowledged message only after `visibility_timeout`, counted from delivery, and kombu
sweeps rarely: a long timeout leaves the request of a dead replica stuck for up to an hour, a short one runs
long requests twice. replicadp keeps kombu's timeout long (a backstop above the hard time limit) and adds
three things, renewed by each replica's main process (and the fence by the pool child too; see below):

- `replicadp:alive:<replica>`: a heartbeat key that expires LEASE seconds after the last renewal.
- `replicadp:holders`: delivery tag -> replica, written when a replica receives a message.
- `replicadp:lock:<request_id>`: the fence; only the delivery holding it computes the request.

Every replica sweeps once a second: a message whose holder's heartbeat has expired goes back to the queue
(kombu's own `restore_by_tag`, a transaction, so concurrent sweepers push it once). A replica also requeues
what is recorded as its own but its process does not hold: at once after a restart under the same name (its
previous process's), and within two ticks when Celery dropped a message after a broker reconnect; and any
message delivered a lease ago that no replica recorded (the broker died as it arrived). A message this
process popped but could not record as delivered (broker/transport.QoS) it puts back once Redis answers.
A sweeper that has just (re)connected waits one lease first, so that a Redis restart, which expires every
heartbeat at once, does not look like every replica dying.

The delivery tag stays the same when kombu redelivers a message, so the tag alone cannot tell two deliveries
apart: the fence lock carries a FenceToken (`<replica>:<pid>:<task id>`, contract/keys.py). A delivery that finds the
lock held by a live other is parked (`Keeper.park`): its message stays in kombu's `unacked`, recorded as held
by `parked:<fence key>` instead of a replica, and its replica serves other requests. Every sweep puts a parked
message whose fence is gone back at the head of the queue: that delivery then finds the stored result, or, if
the one computing it died or failed, takes the fence and computes.

Who renews what. The heartbeat and the holders: the main process, which holds the messages. The fence: both the
pool child computing the request (a thread, `FenceKeeper`) and its main process. So the fence lapses only when
both are gone or stopped: a stopped main process lets its message be requeued, but the copy is parked on the
fence that the child keeps and then returns the child's result; a stopped child's fence is kept by its main
process, which still holds the message. When both stop for longer than a lease, the copy takes the fence and
computes; the stopped child, once resumed, finds the fence another's at its next step (its fence keeper's last
look is then too old to answer for it) or, past the last step, right before it stores, and exits without storing
(see delivery.py).

A request whose frames are computed is finished (encoded, stored, answered) by a thread of its pool child while
the replica computes the next (finisher.py): its main process keeps its message and renews its holder and fence
as a running request's until the child acknowledges it, and requeues it if the child dies first
(`Keeper.finishing`).
"""

from __future__ import annotations

import logging
import threading
import time

import redis

from ..broker import transport
from ..cluster import connection, fence
from ..cluster.fence import TICK_S
from ..cluster.scripts import lua
from ..contract.keys import ALIVE_KEY, HOLDERS_KEY, PARKED, UNACKED_INDEX_KEY, UNACKED_KEY, FenceToken, fence_key
from ..model.parallel import alive

log = logging.getLogger("replicadp")

FORGET = lua(__package__, "forget_holder")


def fence_of(req) -> tuple[str, FenceToken]:
    """The fence key and token of a Celery request running in a pool child, as the main process sees it: the
    same pair that replica.delivery.Delivery builds in the child (its request_id, else its task id)."""
    return (fence_key(str((req.kwargs or {}).get("request_id") or req.id)),
            FenceToken(req.hostname, req.worker_pid, req.id))


def _snapshot(requests) -> list:
    """Celery's request sets, copied while the event loop may be changing them."""
    for _ in range(10):
        try:
            return list(requests())
        except RuntimeError:  # "Set changed size during iteration"
            time.sleep(0.001)
    return list(requests())


class Keeper:
    """One replica's side of the leases; `run()` ticks every TICK_S in a thread of the main process."""

    def __init__(self, name: str, url: str, lease_s: int):
        self.name, self.lease_s = name, lease_s
        self.redis = connection.client(url, socket_timeout=2, socket_connect_timeout=2)
        self.healthy_since: float | None = None
        self.started = False  # False until the first sweep: what this name holds then is a previous process's
        self.missing: dict[str, float] = {}  # tag recorded as ours but not among our requests -> since when
        self.fences: dict[str, FenceToken] = {}  # fence key -> token, of the requests running here at the last tick
        self.qos = None  # kombu's Redis QoS of the replica's channel: its restore_by_tag requeues a message
        self.holding = threading.Lock()  # a tick's renewal of the holders it lists, or a park: one at a time
        # delivery tag -> the Celery request whose pool child finishes it (outcomes.Finishing): held here, as a
        # running request is, until the child acknowledges it (or dies: then it is requeued)
        self.finished_by_child: dict[str, object] = {}

    def run(self, requests) -> None:
        """The lease thread: tick every TICK_S until the process exits. `requests()`: what it holds."""
        while True:
            started = time.monotonic()
            try:
                self.tick(requests)
            except Exception:  # never let the heartbeat die with a bug in one tick
                log.exception("lease: tick failed")
            time.sleep(max(0.0, TICK_S - (time.monotonic() - started)))

    def tick(self, held) -> None:
        """Renew this replica's heartbeat, its holders and the fences of its running and finishing requests
        (settle_finishing first); release the fences of requests that ended here (a pool child killed mid-request
        cannot release its own, and its requeued request must not wait a lease for it); then sweep.
        `held()`: the Celery requests this process holds."""
        try:
            self.settle_finishing()
            # Listed and renewed under the lock: a request parked meanwhile is not recorded as held here again.
            with self.holding:
                requests = _snapshot(held) + list(self.finished_by_child.values())
                fences = dict(fence_of(req) for req in requests if req.worker_pid)
                pipe = self.redis.pipeline(transaction=False)
                pipe.set(ALIVE_KEY + self.name, str(time.time()), px=self.lease_s * 1000)
                for req in requests:
                    pipe.hset(HOLDERS_KEY, req.message.delivery_tag, self.name)
                for key, tok in fences.items():
                    fence.renew(pipe, key, tok, self.lease_s)
                for key, tok in self.fences.items():
                    if fences.get(key) != tok:
                        fence.release(pipe, key, tok)
                pipe.execute()
            self.fences = fences
            if transport.ORPHANS and self.qos is not None:
                transport.put_back_orphans(self.qos.channel, self.redis)
            now = time.time()
            if self.healthy_since is None:
                self.healthy_since = now
            self.sweep({req.message.delivery_tag for req in requests}, now)
        except redis.RedisError as exc:
            if self.healthy_since is not None:
                log.warning("lease: Redis unreachable (%s); sweeping resumes one lease after it is back", exc)
            self.healthy_since = None

    def sweep(self, mine: set, now: float) -> None:
        """Requeue the messages that nobody is going to run: those recorded as held by this replica that its
        process no longer holds (its previous process's, at start-up; or dropped by Celery when its broker
        connection broke), those whose holder's heartbeat expired, those delivered a lease ago that no replica
        ever recorded (the broker died as the message arrived), and parked ones whose fence is gone. Forget
        holders of acknowledged ones."""
        holders = {t.decode(): h.decode() for t, h in self.redis.hgetall(HOLDERS_KEY).items()}
        tags = list(holders)
        delivered = self.redis.hmget(UNACKED_KEY, tags) if tags else []
        names = sorted({h for h in holders.values() if not h.startswith(PARKED)})
        alive = dict(zip(names, self.redis.mget([ALIVE_KEY + n for n in names]))) if names else {}
        dead_sweep = now - self.healthy_since >= self.lease_s + 1  # one lease after (re)connecting
        missing, self.missing = self.missing, {}
        parked = []
        for tag, message in zip(tags, delivered):
            holder = holders[tag]
            if message is None:  # acknowledged
                self.redis.eval(FORGET, 1, HOLDERS_KEY, tag, holder)
                continue
            if tag in mine:
                continue
            if holder.startswith(PARKED):
                parked.append((tag, holder))
            elif holder == self.name:
                # A message arrives before Celery lists it: give it a tick (none at start-up: not ours yet).
                self.missing[tag] = missing.get(tag, now)
                if self.started and now - self.missing[tag] < 2 * TICK_S:
                    continue
                self.requeue(tag, holder, "no longer held by this process")
            elif dead_sweep and alive[holder] is None:
                self.requeue(tag, holder, "heartbeat expired")
        if parked:
            pipe = self.redis.pipeline(transaction=False)
            for _, holder in parked:
                pipe.exists(holder[len(PARKED):])  # one key each: EXISTS of several only counts them
            for (tag, holder), fence in zip(parked, pipe.execute()):
                # Of sweepers that find it at once, the one that forgets its parked holder requeues it.
                if not fence and self.redis.eval(FORGET, 1, HOLDERS_KEY, tag, holder):
                    log.info("lease: message %s, parked on %s, goes back to the queue (the fence is free)", tag,
                             holder[len(PARKED):])
                    self.qos.restore_by_tag(tag, client=self.redis, leftmost=False)
        self.started = True
        if dead_sweep:
            # Every held message is recorded within a tick of its arrival; one unrecorded after a lease has none.
            for tag in self.redis.zrangebyscore(UNACKED_INDEX_KEY, 0, now - self.lease_s - 2 * TICK_S):
                tag = tag.decode()
                if tag not in holders and tag not in mine:
                    self.requeue(tag, None, "no replica recorded it")

    def park(self, req) -> None:
        """`req` found its request computed by another live delivery (outcomes.Parked) and has ended here: record
        its message as held by no replica but parked on that request's fence, for the sweep to requeue once the
        fence is gone. The message stays in kombu's `unacked` (the caller settles it in this process only)."""
        with self.holding:
            self.redis.hset(HOLDERS_KEY, req.message.delivery_tag, PARKED + fence_of(req)[0])

    def finishing(self, req) -> None:
        """`req`'s frames are computed and its pool child finishes it (outcomes.Finishing): keep renewing its holder
        and its fence, as for a running request, until the child acknowledges its message."""
        with self.holding:
            self.finished_by_child[req.message.delivery_tag] = req

    def settle_finishing(self) -> None:
        """Forget the finishing requests whose pool child has acknowledged them; requeue, now, those whose child
        died first (a killed child's finisher dies with it)."""
        if not self.finished_by_child:
            return
        tags = list(self.finished_by_child)
        for tag, message in zip(tags, self.redis.hmget(UNACKED_KEY, tags)):
            req = self.finished_by_child[tag]
            if message is not None and alive(req.worker_pid):
                continue
            with self.holding:
                del self.finished_by_child[tag]
            if message is not None:
                log.warning("lease: the pool child finishing %s died", req.id)
                self.lost(req)

    def lost(self, req) -> None:
        """The pool child running `req` died: release its fence and requeue its message now, not at the next
        tick (the requeued request would wait on the fence)."""
        if req.worker_pid:
            fence.release(self.redis, *fence_of(req))
        self.requeue(req.message.delivery_tag, self.name, "its pool child was lost")

    def requeue(self, tag: str, holder: str | None, why: str) -> None:
        log.warning("lease: requeueing message %s held by %s (%s)", tag, holder or "nobody", why)
        # Back at the head of the queue (kombu pops from the right): it has waited already.
        self.qos.restore_by_tag(tag, client=self.redis, leftmost=False)
        if holder is not None:
            self.redis.eval(FORGET, 1, HOLDERS_KEY, tag, holder)
        self.missing.pop(tag, None)
