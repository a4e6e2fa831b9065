"""The pool child's fence keeper: a thread that keeps the fences of the child's requests and hears their cancels
and preemptions,
so that a denoising step asks Redis nothing while all is well (replica/leases.py tells the whole lease scheme)."""

from __future__ import annotations

import logging
import threading
import time

import redis

from ..cluster import connection, fence
from ..cluster.fence import TICK_S
from ..contract.keys import CANCEL_CHANNEL, CANCEL_KEY, PREEMPT_KEY, FenceToken

log = logging.getLogger("replicadp")


class FenceKeeper:
    """In the pool child: keeps the fences of its requests (the one it computes, and the one its finisher ends),
    and watches for their cancels and preemptions, from a thread, so that a denoising step asks Redis nothing while
    all is well (`clear`). Every TICK_S it renews each fence (so that a fence outlives a stopped main process,
    between steps and through decoding, encoding and storing) and looks for each cancel and preemption key; between
    ticks it hears each at once on CANCEL_CHANNEL. A tick that finds a fence not its delivery's, or a cancel or
    preemption heard, makes that
    request's next step ask Redis itself (replica.delivery.Delivery.on_step), as does a last good look older than two ticks
    (the process was stopped, or the thread could not run). Its own connections, short timeouts: a look that
    fails is made again at the next tick."""

    HEARD_KEEP = 1000  # task ids of cancels (preemptions) heard, kept: one heard just before its request starts here
    # counts

    def __init__(self, url: str, lease_s: int):
        self.redis = connection.client(url, socket_timeout=2, socket_connect_timeout=2)
        self.lease_s = lease_s
        self.watched: dict[FenceToken, str] = {}  # delivery -> its fence key, of the requests kept
        self.clear_at: dict[FenceToken, float] = {}  # when (monotonic) a look last found all well for one
        self.heard: dict[str, None] = {}  # task ids of the cancels and preemptions heard, oldest first
        self.looking = threading.Lock()  # a look, or an unwatch: a fence let go is not renewed by a look under way

    def watch(self, fence: str, tok: FenceToken) -> None:
        """From now on, keep `fence` for `tok`, which has just taken it. A cancel since the request started is
        already heard (`heard`), or, set without being published, found at the next tick."""
        self.clear_at[tok] = time.monotonic()
        self.watched[tok] = fence

    def unwatch(self, tok: FenceToken) -> None:
        """Stop keeping `tok`'s fence: its request has ended here, or is about to release it. Waits for a look
        under way, so that no renewal of the fence follows."""
        with self.looking:
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
        """Renew the fences kept and look for their cancels and preemptions, in one round trip."""
        with self.looking:
            watched = list(self.watched.items())
            if not watched:
                return
            pipe = self.redis.pipeline(transaction=False)
            for tok, key in watched:
                pipe.exists(CANCEL_KEY + tok.task_id, PREEMPT_KEY + tok.task_id)  # how many of the two exist
                fence.renew(pipe, key, tok, self.lease_s)
            replies = pipe.execute()
        for (tok, key), cancelled, renewed in zip(watched, replies[::2], replies[1::2]):
            if cancelled:
                self.hear(tok.task_id)
            if self.watched.get(tok) == key:
                self.clear_at[tok] = time.monotonic() if renewed and not cancelled else float("-inf")

    def forget(self, task_id: str) -> None:
        """Its preemption is over: the request, when it goes on here, need not ask Redis at every step."""
        self.heard.pop(task_id, None)

    def hear(self, task_id: str) -> None:
        self.heard[task_id] = None
        if len(self.heard) > self.HEARD_KEEP:
            del self.heard[next(iter(self.heard))]
