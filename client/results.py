"""The result waiter: each new state of the requests a process awaits, as the replicas store them.

One pub/sub connection per process, on a pattern (Celery's result backend publishes every state it stores on
the result's key), so that a request costs no subscribe of its own; and a full read of every awaited result each
SWEEP_S, which catches what pub/sub missed (a result stored before it was awaited, a Redis restart). Waiting
on pub/sub, not polling: a polling client takes compute from the replicas on a small host and adds up to a poll
interval to every latency (docs/benchmarks.md, figures 2 and 4).

The producer API (`run_requests`) and the HTTP gateway both wait through it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import redis

from replicadp_tasks.contract import RequestState

log = logging.getLogger("replicadp")

SWEEP_S = 1.0  # every awaited result is read in full this often, besides the pub/sub notifications
RECONNECT_S = 0.5  # after Redis went away: wait this long, subscribe again and catch up


class ResultWatch:
    """Calls `on_state(task_id, meta)` from its own thread with each state stored for an awaited task (the same
    state may come twice: from pub/sub and from a sweep). `meta` is the backend's decoded meta (`status`,
    `result`, ...); a result that cannot be decoded comes as a FAILURE whose result is the decoding error."""

    def __init__(self, backend, on_state: Callable[[str, dict], None]):
        self.backend, self.on_state = backend, on_state
        self._awaited: dict[bytes, str] = {}  # result key (also its channel) -> task id
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="replicadp-results", daemon=True)

    def start(self) -> "ResultWatch":
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop awaiting. The thread ends, and closes its connection, once its read in progress returns (within
        SWEEP_S); it is not waited for, so that a caller that has its results goes on at once."""
        self._closed.set()

    def watch(self, task_id: str) -> None:
        """Await `task_id`: call it before the task is sent, so that no state of it passes unseen."""
        with self._lock:
            self._awaited[self._key(task_id)] = task_id

    def unwatch(self, task_id: str) -> None:
        with self._lock:
            self._awaited.pop(self._key(task_id), None)

    def _key(self, task_id: str) -> bytes:
        key = self.backend.get_key_for_task(task_id)
        return key if isinstance(key, bytes) else key.encode()

    def _deliver(self, key: bytes, raw) -> None:
        task_id = self._awaited.get(key)
        if task_id is None or raw is None:
            return
        try:
            meta = self.backend.decode_result(raw)
        except Exception as exc:  # noqa: BLE001 (the request waiting on it gets the error; the watch goes on)
            meta = {"status": RequestState.FAILURE, "result": exc}
        self.on_state(task_id, meta)

    def _sweep(self) -> None:
        with self._lock:
            keys = list(self._awaited)
        for start in range(0, len(keys), 500):
            chunk = keys[start:start + 500]
            for key, raw in zip(chunk, self.backend.client.mget(chunk)):
                self._deliver(key, raw)

    def _run(self) -> None:
        while not self._closed.is_set():
            pubsub = self.backend.client.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.psubscribe(self.backend.get_key_for_task("*"))
                self._sweep()  # what was stored while we were not subscribed
                swept = time.monotonic()
                while not self._closed.is_set():
                    message = pubsub.get_message(timeout=SWEEP_S)
                    if message is not None:
                        self._deliver(message["channel"], message["data"])
                    if time.monotonic() - swept >= SWEEP_S:
                        self._sweep()
                        swept = time.monotonic()
            except (redis.RedisError, OSError) as exc:  # Redis restarting: subscribe again and catch up
                log.debug("result watch: %r; reconnecting", exc)
                self._closed.wait(RECONNECT_S)
            except Exception:  # a bug in on_state must not stop every waiter of this process
                log.exception("result watch: a state could not be handed over")
                self._closed.wait(RECONNECT_S)
            finally:
                try:
                    pubsub.close()
                except (redis.RedisError, OSError):
                    pass
