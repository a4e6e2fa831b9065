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
process popped but could not record as delivered (transport.QoS) it puts back once Redis answers.
A sweeper that has just (re)connected waits one lease first, so that a Redis restart, which expires every
heartbeat at once, does not look like every replica dying.

The delivery tag stays the same when kombu redelivers a message, so the tag alone cannot tell two deliveries
apart: the fence lock carries a FenceToken (`<replica>:<pid>:<task id>`, keys.py). A delivery that finds the
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
(see tasks.py).

A request whose frames are computed is finished (encoded, stored, answered) by a thread of its pool child while
the replica computes the next (finisher.py): its main process keeps its message and renews its holder and fence
as a running request's until the child acknowledges it, and requeues it if the child dies first
(`Keeper.finishing`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from enum import StrEnum
from typing import NamedTuple

import redis

from . import connection
from ..broker import transport
from ..contract.keys import (ALIVE_KEY, CANCEL_CHANNEL, CANCEL_KEY, HOLDERS_KEY, PARKED, UNACKED_INDEX_KEY,
                             UNACKED_KEY, FenceToken, fence_key)

log = logging.getLogger("replicadp")

TICK_S = 1.0  # renewal and sweep period: a lease of 6 s survives 5 missed ticks

# Take the lock if free, or renew it if ours; else say who owns it (atomically: it cannot expire in between).
_ACQUIRE = ("if redis.call('set', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 'acquired' end "
            "local owner = redis.call('get', KEYS[1]) "
            "if owner == ARGV[1] then redis.call('pexpire', KEYS[1], ARGV[2]) return 'held' end return owner")
# Renew the lock only while we own it; release it only if we still own it.
_RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
# Unless KEYS[2] (the cancel key) exists, release the lock if we still own it: 1 (not cancelled), else 0.
_RELEASE_UNLESS = ("if redis.call('exists', KEYS[2]) == 1 then return 0 end "
                   "if redis.call('get', KEYS[1]) == ARGV[1] then redis.call('del', KEYS[1]) end return 1")
# Forget a holder only if it is still the one we saw: the message may already be held again elsewhere.
_FORGET = "if redis.call('hget', KEYS[1], ARGV[1]) == ARGV[2] then return redis.call('hdel', KEYS[1], ARGV[1]) end return 0"


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


def fence_of(req) -> tuple[str, FenceToken]:
    """The fence key and token of a Celery request running in a pool child, as the main process sees it: the
    same pair that tasks.Delivery builds in the child (its request_id, else its task id)."""
    return (fence_key(str((req.kwargs or {}).get("request_id") or req.id)),
            FenceToken(req.hostname, req.worker_pid, req.id))


def _answer(reply: bytes) -> FenceAnswer:
    reply = reply.decode()
    if reply in (FenceState.ACQUIRED, FenceState.HELD):
        return FenceAnswer(FenceState(reply))
    return FenceAnswer(FenceState.TAKEN, reply)


# --- in the pool child: the fence -----------------------------------------------------------------------

def acquire(r: redis.Redis, key: str, tok: FenceToken, lease_s: int) -> FenceAnswer:
    """Take the fence for this delivery, or renew it if this delivery holds it; else say who holds it."""
    return _answer(r.eval(_ACQUIRE, 1, key, str(tok), lease_s * 1000))


def acquire_unless(r: redis.Redis, key: str, tok: FenceToken, lease_s: int, cancel_key: str) -> FenceAnswer:
    """CANCELLED if `cancel_key` exists, else what acquire() answers. One round trip."""
    pipe = r.pipeline(transaction=False)
    pipe.exists(cancel_key)
    pipe.eval(_ACQUIRE, 1, key, str(tok), lease_s * 1000)
    cancelled, reply = pipe.execute()
    return FenceAnswer(FenceState.CANCELLED) if cancelled else _answer(reply)


def release(r: redis.Redis, key: str, tok: FenceToken) -> None:
    r.eval(_RELEASE, 1, key, str(tok))


def release_unless(pipe, key: str, tok: FenceToken, cancel_key: str) -> None:
    """Queue on `pipe`: release the fence unless `cancel_key` exists (a cancelled request keeps its fence until
    its stored video is removed). Its reply: 1 if not cancelled, else 0."""
    pipe.eval(_RELEASE_UNLESS, 2, key, cancel_key, str(tok))


class FenceKeeper:
    """In the pool child: keeps the fences of its requests (the one it computes, and the one its finisher ends),
    and watches for their cancels, from a thread, so that a denoising step asks Redis nothing while all is well
    (`clear`). Every TICK_S it renews each fence (so that a fence outlives a stopped main process, between steps
    and through decoding, encoding and storing) and looks for each cancel key; between ticks it hears each cancel
    at once on CANCEL_CHANNEL. A tick that finds a fence not its delivery's, or a cancel heard, makes that
    request's next step ask Redis itself (tasks.Delivery.on_step), as does a last good look older than two ticks
    (the process was stopped, or the thread could not run). Its own connections, short timeouts: a look that
    fails is made again at the next tick."""

    HEARD_KEEP = 1000  # task ids of cancels heard, kept: one heard just before its request starts here counts

    def __init__(self, url: str, lease_s: int):
        self.redis = connection.client(url, socket_timeout=2, socket_connect_timeout=2)
        self.lease_s = lease_s
        self.watched: dict[FenceToken, str] = {}  # delivery -> its fence key, of the requests kept
        self.clear_at: dict[FenceToken, float] = {}  # when (monotonic) a look last found all well for one
        self.heard: dict[str, None] = {}  # task ids of the cancels heard, oldest first

    def watch(self, fence: str, tok: FenceToken) -> None:
        """From now on, keep `fence` for `tok`, which has just taken it. A cancel since the request started is
        already heard (`heard`), or, set without being published, found at the next tick."""
        self.clear_at[tok] = time.monotonic()
        self.watched[tok] = fence

    def unwatch(self, tok: FenceToken) -> None:
        """Stop keeping `tok`'s fence: its request has ended here."""
        self.watched.pop(tok, None)
        self.clear_at.pop(tok, None)

    def clear(self, tok: FenceToken) -> bool:
        """Whether the fence was `tok`'s and no cancel of its task was seen, at a look within two ticks."""
        return (tok in self.watched and tok.task_id not in self.heard
                and time.monotonic() - self.clear_at.get(tok, float("-inf")) < 2 * TICK_S)

    def run(self) -> None:
        failing, channel, next_tick = False, None, time.monotonic()
        while True:
            try:
                if channel is None:
                    channel = self.redis.pubsub(ignore_subscribe_messages=True)
                    channel.subscribe(CANCEL_CHANNEL)
                if time.monotonic() >= next_tick:
                    next_tick = time.monotonic() + TICK_S
                    self.look()
                message = channel.get_message(timeout=max(0.0, next_tick - time.monotonic()))
                if message is not None:
                    data = message["data"]
                    self.hear(data.decode() if isinstance(data, bytes) else data)
                failing = False
            except redis.RedisError as exc:
                if not failing:  # once per outage, not once a second
                    log.warning("lease: cannot keep the fence or hear cancels: %s", exc)
                failing = True
                if channel is not None:
                    channel.close()
                channel = None
                time.sleep(max(0.0, next_tick - time.monotonic()))

    def look(self) -> None:
        """Renew the fences kept and look for their cancels, in one round trip."""
        watched = list(self.watched.items())
        if not watched:
            return
        pipe = self.redis.pipeline(transaction=False)
        for tok, key in watched:
            pipe.exists(CANCEL_KEY + tok.task_id)
            pipe.eval(_RENEW, 1, key, str(tok), self.lease_s * 1000)
        replies = pipe.execute()
        for (tok, key), cancelled, renewed in zip(watched, replies[::2], replies[1::2]):
            if cancelled:
                self.hear(tok.task_id)
            if self.watched.get(tok) == key:
                self.clear_at[tok] = time.monotonic() if renewed and not cancelled else float("-inf")

    def hear(self, task_id: str) -> None:
        self.heard[task_id] = None
        if len(self.heard) > self.HEARD_KEEP:
            del self.heard[next(iter(self.heard))]


def _alive(pid: int) -> bool:
    """Whether process `pid` exists (a child of this process: its pid is not reused before it is reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _snapshot(requests) -> list:
    """Celery's request sets, copied while the event loop may be changing them."""
    for _ in range(10):
        try:
            return list(requests())
        except RuntimeError:  # "Set changed size during iteration"
            time.sleep(0.001)
    return list(requests())


# --- in the main process: heartbeat, renewal, sweep -------------------------------------------------------

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
        # delivery tag -> the Celery request whose pool child finishes it (errors.Finishing): held here, as a
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
                    pipe.eval(_RENEW, 1, key, str(tok), self.lease_s * 1000)
                for key, tok in self.fences.items():
                    if fences.get(key) != tok:
                        pipe.eval(_RELEASE, 1, key, str(tok))
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
                self.redis.eval(_FORGET, 1, HOLDERS_KEY, tag, holder)
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
                if not fence and self.redis.eval(_FORGET, 1, HOLDERS_KEY, tag, holder):
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
        """`req` found its request computed by another live delivery (errors.Parked) and has ended here: record
        its message as held by no replica but parked on that request's fence, for the sweep to requeue once the
        fence is gone. The message stays in kombu's `unacked` (the caller settles it in this process only)."""
        with self.holding:
            self.redis.hset(HOLDERS_KEY, req.message.delivery_tag, PARKED + fence_of(req)[0])

    def finishing(self, req) -> None:
        """`req`'s frames are computed and its pool child finishes it (errors.Finishing): keep renewing its holder
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
            if message is not None and _alive(req.worker_pid):
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
            release(self.redis, *fence_of(req))
        self.requeue(req.message.delivery_tag, self.name, "its pool child was lost")

    def requeue(self, tag: str, holder: str | None, why: str) -> None:
        log.warning("lease: requeueing message %s held by %s (%s)", tag, holder or "nobody", why)
        # Back at the head of the queue (kombu pops from the right): it has waited already.
        self.qos.restore_by_tag(tag, client=self.redis, leftmost=False)
        if holder is not None:
            self.redis.eval(_FORGET, 1, HOLDERS_KEY, tag, holder)
        self.missing.pop(tag, None)
