"""The producer-side Python API: submit requests, iterate results as they complete, fetch videos.

    from client import run_requests, fetch_video
    for outcome in run_requests([{"prompt": "a fox", "seed": 1}], concurrency=4):
        print(outcome.ok, outcome.result or outcome.error)
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator
from urllib.parse import urlsplit, urlunsplit

import redis
from celery import Celery

from replicadp_tasks import app, generate
from replicadp_tasks.settings import SETTINGS
from replicadp_tasks.store import fetch_video as _fetch

POLL_S = 0.01  # one MGET for every request in flight; 10 ms is below any request's cost


class ClientError(Exception):
    """Raised when the client cannot do its job at all (Redis unreachable); a failed request is not one."""


@dataclass
class Outcome:
    """One request's end: its metadata on success, its error message on failure."""

    index: int
    request: dict
    task_id: str
    submitted_at: float
    finished_at: float = 0.0
    ok: bool = False
    result: dict | None = None
    error: str | None = None

    @property
    def latency_s(self) -> float:
        return self.finished_at - self.submitted_at


@dataclass
class InFlight:
    """What a running request last reported: its state and denoising step."""

    outcome: Outcome
    state: str = "PENDING"
    step: int = 0
    total_steps: int = 0
    replica: str | None = None
    extra: dict = field(default_factory=dict)


def redacted(url: str) -> str:
    """A Redis URL without its password, for messages and logs."""
    parts = urlsplit(url)
    if parts.password:
        host = parts.hostname + (f":{parts.port}" if parts.port else "")
        return urlunsplit(parts._replace(netloc=f":***@{host}"))
    return url


def redis_url() -> str:
    return app.conf.broker_url


def use_redis(url: str) -> None:
    """Point this process, and the replicas it starts, at `url`: for a server started after import (the demo,
    the tests). Call it once, before the first request: the app's connection pools keep the first URL."""
    os.environ["REDIS_URL"] = url
    app.conf.update(broker_url=url, result_backend=url)


def check_redis(url: str | None = None, timeout: float = 3.0) -> None:
    """Fail within seconds, with the URL (password hidden), when Redis cannot be reached."""
    url = url or redis_url()
    try:
        redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout).ping()
    except redis.exceptions.RedisError as exc:
        raise ClientError(f"cannot reach Redis at {redacted(url)} (set REDIS_URL, or run `replicadp up`): {exc}") from exc


@functools.lru_cache(maxsize=None)
def _app_for(url: str) -> Celery:
    """A Celery app on another Redis: control commands publish through the app's own producer pool, so a
    connection argument alone would not reach replicas on another server or DB."""
    other = Celery("replicadp", set_as_current=False)
    other.config_from_object("celeryconfig")
    other.conf.update(broker_url=url, result_backend=url)
    return other


def live_replicas(timeout: float = 1.0, url: str | None = None) -> list[str]:
    """Replicas that hold their model and consume the shared queue (on `url`, default this app's Redis)."""
    control_app = app if url in (None, redis_url()) else _app_for(url)
    queues = control_app.control.inspect(timeout=timeout).active_queues() or {}
    return sorted(name for name, qs in queues.items() if any(q["name"] == SETTINGS.queue for q in qs))


def fetch_video(result: dict) -> bytes:
    """The MP4 bytes of a successful result, from whichever store the replica used."""
    return _fetch(result["video_uri"], redis_url())


def error_message(info) -> str:
    """'Type: message' from a FAILURE result (the backend hands back the exception rebuilt)."""
    if isinstance(info, BaseException):
        return f"{type(info).__name__}: {info}"
    return str(info)


def _send(request: dict) -> str:
    # Keep only the id: an AsyncResult object would keep a pub/sub subscription whose messages nobody reads.
    return generate.apply_async(kwargs=request).id


def run_requests(requests: Iterable[dict], concurrency: int = 0, timeout: float = 1800.0,
                 on_update: Callable[[list[InFlight], Outcome | None], None] | None = None) -> Iterator[Outcome]:
    """Submit `requests` keeping at most `concurrency` in flight (0: all at once), and yield each Outcome as
    its request completes. A request that fails or passes `timeout` seconds yields ok=False; the others go on.
    `on_update(in_flight, finished)` is called after each poll that changed something."""
    check_redis()
    pending = list(enumerate(requests))
    pending.reverse()
    limit = concurrency if concurrency > 0 else len(pending)
    backend = app.backend
    flying: dict[str, InFlight] = {}
    while pending or flying:
        while pending and len(flying) < limit:
            index, request = pending.pop()
            now = time.time()
            task_id = _send(request)
            flying[task_id] = InFlight(Outcome(index, request, task_id, now))
        ids = list(flying)
        raws = backend.client.mget([backend.get_key_for_task(t) for t in ids])
        now = time.time()
        changed = False
        for task_id, raw in zip(ids, raws):
            entry = flying[task_id]
            out = entry.outcome
            if raw is None:
                if now - out.submitted_at > timeout:
                    out.error = f"timed out after {timeout:.0f} s (still queued: is any replica live?)"
                else:
                    continue
            else:
                meta = backend.decode_result(raw)
                status, info = meta["status"], meta.get("result")
                if status == "SUCCESS":
                    out.ok, out.result = True, info
                elif status == "FAILURE":
                    out.error = error_message(info)
                elif now - out.submitted_at > timeout:
                    out.error = f"timed out after {timeout:.0f} s ({status})"
                else:
                    if status != entry.state or (isinstance(info, dict) and info.get("step", 0) != entry.step):
                        entry.state = status
                        if isinstance(info, dict):
                            entry.step = info.get("step", entry.step)
                            entry.total_steps = info.get("total_steps", entry.total_steps)
                            entry.replica = info.get("replica") or info.get("hostname") or entry.replica
                        changed = True
                    continue
            out.finished_at = now
            del flying[task_id]
            if on_update:
                on_update(list(flying.values()), out)
            yield out
        if changed and on_update:
            on_update(list(flying.values()), None)
        if flying and not (pending and len(flying) < limit):
            time.sleep(POLL_S)
