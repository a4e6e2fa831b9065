"""The producer-side Python API: submit requests, iterate results as they complete, fetch videos.

    from client import run_requests, fetch_video
    for outcome in run_requests([{"prompt": "a fox", "seed": 1}], concurrency=4):
        print(outcome.ok, outcome.result or outcome.error)
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator
from urllib.parse import urlsplit, urlunsplit

import redis
from celery import Celery

from replicadp_tasks import app, generate
from replicadp_tasks.settings import SETTINGS
from replicadp_tasks.store import fetch_video as _fetch

SWEEP_S = 1.0  # how often every result in flight is read in full, besides the pub/sub notifications


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
    return _fetch(result["video_uri"], redis_url(), result.get("video_sha256"))


def error_message(info) -> str:
    """'Type: message' from a FAILURE result (the backend hands back the exception rebuilt)."""
    if isinstance(info, BaseException):
        return f"{type(info).__name__}: {info}"
    return str(info)


def cancel_request(task_id: str) -> None:
    """Cancel a request: a queued one fails as RequestCancelled when a replica takes it, a running one at its
    next denoising step; the replica keeps its model either way. A request that has ended is left as it is."""
    from replicadp_tasks.worker import CANCEL_KEY

    app.backend.client.set(CANCEL_KEY + task_id, 1, ex=SETTINGS.result_ttl_s)


def _send(request: dict) -> str:
    # Keep only the id: an AsyncResult object would keep a pub/sub subscription whose messages nobody reads.
    return generate.apply_async(kwargs=request).id


def run_requests(requests: Iterable[dict], concurrency: int = 0, timeout: float = 1800.0,
                 on_update: Callable[[list[InFlight], Outcome | None], None] | None = None) -> Iterator[Outcome]:
    """Submit `requests` keeping at most `concurrency` in flight (0: all at once), and yield each Outcome as
    its request completes. A request that fails or passes `timeout` seconds yields ok=False; the others go on.
    `on_update(in_flight, finished)` is called whenever a request in flight changes state or step.

    Waits on the result backend's pub/sub channels instead of polling: a polling client costs the replicas
    compute on a small host (measured: inference 10% slower on 2 cores with a 10 ms poll) and adds up to a
    poll interval to every latency. A full read of every result in flight each SWEEP_S catches what pub/sub
    missed (a result stored before we subscribed, a reconnect) and enforces the timeout."""
    check_redis()
    pending = list(enumerate(requests))
    pending.reverse()
    limit = concurrency if concurrency > 0 else len(pending)
    backend = app.backend
    flying: dict[str, InFlight] = {}
    keys: dict[bytes, str] = {}  # result key (also its pub/sub channel) -> task id
    pubsub = backend.client.pubsub(ignore_subscribe_messages=True)

    def settle(task_id: str, meta: dict | None, now: float) -> Outcome | None:
        """Record what a result says; the Outcome if the request has ended."""
        entry = flying[task_id]
        out = entry.outcome
        status = meta["status"] if meta else "PENDING"
        info = meta.get("result") if meta else None
        if status == "SUCCESS":
            out.ok, out.result = True, info
        elif status == "FAILURE":
            out.error = error_message(info)
        elif now - out.submitted_at > timeout:
            where = "still queued: is any replica live?" if status == "PENDING" else status
            out.error = f"timed out after {timeout:.0f} s ({where})"
        else:
            if isinstance(info, dict) and (status, info.get("step", 0)) != (entry.state, entry.step):
                entry.step = info.get("step", entry.step)
                entry.total_steps = info.get("total_steps", entry.total_steps)
                entry.replica = info.get("replica") or info.get("hostname") or entry.replica
                if on_update:
                    on_update(list(flying.values()), None)
            entry.state = status
            return None
        out.finished_at = now
        del flying[task_id]
        pubsub.unsubscribe(backend.get_key_for_task(task_id))
        if on_update:
            on_update(list(flying.values()), out)
        return out

    def sweep(task_ids) -> Iterator[Outcome]:
        task_ids = list(task_ids)
        try:
            raws = backend.client.mget([backend.get_key_for_task(t) for t in task_ids]) if task_ids else []
        except redis.exceptions.ConnectionError:  # Redis restarting: the next sweep reads them
            raws = [None] * len(task_ids)  # (but the timeout still applies)
        now = time.time()
        for task_id, raw in zip(task_ids, raws):
            done = settle(task_id, backend.decode_result(raw) if raw else None, now)
            if done:
                yield done

    last_sweep = time.monotonic()
    while pending or flying:
        sent = []
        while pending and len(flying) < limit:
            index, request = pending.pop()
            now = time.time()
            task_id = _send(request)
            flying[task_id] = InFlight(Outcome(index, request, task_id, now))
            key = backend.get_key_for_task(task_id)
            keys[key] = task_id
            sent.append(key)
        if sent:
            pubsub.subscribe(*sent)
            yield from sweep(keys[k] for k in sent)  # results stored before the subscription took effect
        if time.monotonic() - last_sweep > SWEEP_S:
            last_sweep = time.monotonic()
            yield from sweep(flying)
        if not flying:
            continue
        try:
            message = pubsub.get_message(timeout=SWEEP_S)
        except redis.exceptions.ConnectionError:  # Redis restarting: reconnect, resubscribe, catch up
            time.sleep(0.5)
            try:
                fresh = backend.client.pubsub(ignore_subscribe_messages=True)
                fresh.subscribe(*[backend.get_key_for_task(t) for t in flying])
                pubsub = fresh
            except redis.exceptions.ConnectionError:
                pass  # still down: try again after the next sweep
            last_sweep = 0.0
            continue
        while message is not None:
            task_id = keys.get(message["channel"])
            if task_id in flying:
                done = settle(task_id, backend.decode_result(message["data"]), time.time())
                if done:
                    yield done
            try:
                message = pubsub.get_message(timeout=0)
            except redis.exceptions.ConnectionError:  # the next wait reconnects
                message = None
    pubsub.close()
