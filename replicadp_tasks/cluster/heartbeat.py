"""Who serves: each replica's heartbeat in Redis, so that a producer learns the live replicas in one read.

A Celery broadcast (`inspect active_queues`) answers the same question, but a caller cannot tell the last reply
from a late one and waits out its whole timeout (a second) every time. So each replica's main process beats,
every BEAT_S from a thread, into one of two sorted sets, replica name -> Redis's time of the beat (one clock for
every host):

- `replicadp:serving` while it consumes its model's queue: its pool child holds the model and it takes requests;
- `replicadp:standby` while it does not: its pool child is loading (or reloading) the model, it is stopping, or
  its consumer of its model's queue was cancelled;

and records the request its pool child runs in `replicadp:running`. A change of state is in Redis within
WATCH_S (the thread looks at the consumer that often, without Redis); a replica that dies without a word
(SIGKILL) stops beating, and readers drop it once its beat is SETTINGS.replica_stale_s old. The lease heartbeat
(`replicadp:alive:*`, replica/leases.py) says something else: that a main process lives and holds its messages, serving
or not.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Callable, Iterable, NamedTuple, TypedDict

import redis

from ..contract.keys import MODELS_KEY, RUNNING_KEY, SERVING_KEY, STANDBY_KEY
from . import connection, fleet
from .scripts import lua

log = logging.getLogger("replicadp")

BEAT_S = 1.0  # beat period: a stale bound of a few seconds survives a few late beats
WATCH_S = 0.1  # how often the thread looks whether the replica still (or now) consumes: no Redis call

BEAT = lua(__package__, "beat")


class Running(TypedDict):
    """The request a replica's pool child runs, as its main process sees it."""

    task_id: str
    started_at: float  # when the pool child took it (the replica's clock)
    priority: str  # its contract.scheduling.Priority (what the preemption policy weighs)


class Beats(NamedTuple):
    """What the heartbeats say, read at once: the replicas that serve, those that do not (yet), what each runs."""

    serving: list[str]
    standby: list[str]
    running: dict[str, Running]


def _fresh(now_reply, members, stale_s: float) -> list[str]:
    seconds, micros = now_reply
    now = int(seconds) + int(micros) / 1e6
    return sorted(m.decode() for m, beat in members if beat > now - stale_s)


def read(client: redis.Redis, stale_s: float) -> Beats:
    """Every live replica, serving (`serving`: those that hold their model and consume its model's queue) or not,
    and the request each runs: one round trip."""
    pipe = client.pipeline(transaction=False)
    pipe.time()
    pipe.zrange(SERVING_KEY, 0, -1, withscores=True)
    pipe.zrange(STANDBY_KEY, 0, -1, withscores=True)
    pipe.hgetall(RUNNING_KEY)
    now, serving_, standby, running = pipe.execute()
    serving_, standby = _fresh(now, serving_, stale_s), _fresh(now, standby, stale_s)
    live = {*serving_, *standby}
    return Beats(serving_, standby, {n.decode(): json.loads(r) for n, r in running.items() if n.decode() in live})


class Heartbeat:
    """In a replica's main process: `run()` beats from a thread until `leave()`. `consuming()` says whether the
    replica takes requests from its model's queue now, `running()` what its pool child runs; both are called
    from the thread, so they only read. Each beat declares `models` (fleet.py: the replica's own, and those its
    REPLICADP_MODELS names), queued under `prefix`."""

    def __init__(self, name: str, url: str, stale_s: float, consuming: Callable[[], bool],
                 running: Callable[[], Running | None], models: Iterable[str], prefix: str):
        self.name, self.stale_s = name, stale_s
        self.declarations = [part for model in dict.fromkeys(models)
                             for part in (model, fleet.declaration(model, prefix, name))]
        self.consuming, self.running = consuming, running
        # Its own connection, short timeouts: a beat that fails is retried at the next one.
        self.redis = connection.client(url, socket_timeout=2, socket_connect_timeout=2)
        self._beat = self.redis.register_script(BEAT)
        self._left = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "Heartbeat":
        self._thread = threading.Thread(target=self.run, name="replicadp-heartbeat", daemon=True)
        self._thread.start()
        return self

    def run(self) -> None:
        beaten, last, failing = None, 0.0, False
        while not self._left.is_set():
            state = (self.consuming(), self.running())
            if state != beaten or time.monotonic() - last >= BEAT_S:
                beaten, last = state, time.monotonic()  # a failed beat too: the next is due in BEAT_S
                try:
                    self.beat(*state)
                    failing = False
                except redis.RedisError as exc:
                    if not failing:  # once per outage, not once a beat
                        log.warning("heartbeat: cannot reach Redis: %s", exc)
                    failing = True
            self._left.wait(WATCH_S)

    def beat(self, consuming: bool, running: Running | None) -> None:
        on, off = (SERVING_KEY, STANDBY_KEY) if consuming else (STANDBY_KEY, SERVING_KEY)
        self._beat(keys=[on, off, RUNNING_KEY, MODELS_KEY], args=[
            self.name, json.dumps(running) if running else "", self.stale_s, *self.declarations])

    def leave(self) -> None:
        """At the end of a warm shutdown: stop beating and take this replica out of the heartbeats at once."""
        self._left.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            pipe = self.redis.pipeline()
            pipe.zrem(SERVING_KEY, self.name)
            pipe.zrem(STANDBY_KEY, self.name)
            pipe.hdel(RUNNING_KEY, self.name)
            pipe.execute()
        except redis.RedisError as exc:  # its beats go stale instead
            log.warning("heartbeat: cannot leave: %s", exc)
