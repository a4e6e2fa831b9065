"""The producer-side Python API: submit requests, iterate results as they complete, fetch videos.

    from client import run_requests, fetch_video
    for outcome in run_requests([{"prompt": "a fox", "seed": 1}], concurrency=4):
        print(outcome.ok, outcome.result or outcome.error)
"""

from __future__ import annotations

import functools
import json
import os
import queue
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import redis
from celery import Celery

from replicadp_tasks import app, generate
from replicadp_tasks.app import check_one_redis
from replicadp_tasks.broker import ModelRouter, fleet, transport_for

from replicadp_tasks.cluster import connection, heartbeat, preempt, redacted, replication
from replicadp_tasks.contract import InvalidRequest, RequestState, Result, keys
from replicadp_tasks.outputs import delete_stored, fetch_video as _fetch, with_video_url
from replicadp_tasks.settings import SETTINGS

from .results import SWEEP_S, ResultWatch



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
    result: Result | None = None  # the stored Result, on success
    error: str | None = None

    @property
    def latency_s(self) -> float:
        return self.finished_at - self.submitted_at


@dataclass
class InFlight:
    """What a running request last reported: its state, phase (records.Phase) and denoising step."""

    outcome: Outcome
    state: str = RequestState.PENDING
    phase: str | None = None
    step: int = 0
    total_steps: int = 0
    replica: str | None = None


def redis_url() -> str:
    """This process's Redis URL: Celery's broker is the same Redis, but a Sentinel URL reaches Celery without its
    master's name (connection.celery_url)."""
    return app.conf.replicadp_redis_url


def _on(url: str) -> dict:
    """The Celery settings that name the Redis at `url`: broker, result backend, and the transport for its scheme."""
    import celeryconfig

    options = connection.celery_options(url)
    broker = {k: v for k, v in celeryconfig.broker_transport_options.items() if k not in connection.CELERY_OPTIONS}
    return {"replicadp_redis_url": url, "broker_url": connection.celery_url(url),
            "result_backend": connection.celery_backend_url(url), "broker_transport": transport_for(url),
            "broker_transport_options": broker | options, "result_backend_transport_options": options}


def use_redis(url: str) -> None:
    """Point this process, and the replicas it starts, at `url`: for a server started after import (the demo,
    the tests). Call it once, before the first request: the app's connection pools keep the first URL."""
    os.environ["REDIS_URL"] = url
    app.conf.update(_on(url))
    check_one_redis(app.conf)  # CELERY_BROKER_URL and the like would still win over it


def check_redis(url: str | None = None, timeout: float = 3.0) -> None:
    """Fail within seconds, with the URL (password hidden), when Redis cannot be reached."""
    url = url or redis_url()
    try:
        connection.client(url, socket_connect_timeout=timeout, socket_timeout=timeout).ping()
    except redis.exceptions.RedisError as exc:
        raise ClientError(f"cannot reach Redis at {redacted(url)} (set REDIS_URL or --redis-url, or run "
                          f"`replicadp up`): {exc}") from exc


@functools.lru_cache(maxsize=None)
def _app_for(url: str) -> Celery:
    """A Celery app on another Redis: control commands publish through the app's own producer pool, so a
    connection argument alone would not reach replicas on another server or DB."""
    other = Celery("replicadp", set_as_current=False)
    other.config_from_object("celeryconfig")
    other.conf.update(_on(url), task_routes=(ModelRouter(other),))  # the models declared on its Redis
    return other


@functools.lru_cache(maxsize=None)
def redis_client(url: str, timeout: float) -> redis.Redis:
    """A client of the Redis at `url` whose calls give up after `timeout` seconds, kept for the next call."""
    return connection.client(url, socket_timeout=timeout, socket_connect_timeout=timeout)


def live_replicas(timeout: float = 1.0, url: str | None = None, model: str | None = None) -> list[str]:
    """Replicas that hold their model and consume its queue (on `url`, default this app's Redis): those whose
    serving heartbeat is fresher than REPLICADP_REPLICA_STALE (heartbeat.py); `model`: only its replicas. One read
    (two with a model); `timeout`: seconds to wait for Redis."""
    client = redis_client(url or redis_url(), timeout)
    serving = heartbeat.read(client, SETTINGS.replica_stale_s).serving
    if model is None:
        return serving
    return [name for name, info in replica_info(client, serving).items() if info.get("model") == model]


def replica_info(client, names) -> dict:
    """What each replica published when it loaded its model (its ReplicaInfo: model, device, pid, ...; {} before)."""
    raws = client.mget([keys.REPLICA_KEY + n for n in names]) if names else []
    return {n: json.loads(r) if r else {} for n, r in zip(names, raws)}


def model_for(asked: str | None) -> str:
    """The model a request naming `asked` (None: none) runs on: the deployment's default for None. InvalidRequest
    naming `model` and the served ones for a model the deployment does not serve, or when none is named and it
    serves several."""
    return fleet(app).choose(asked)


def fetch_video(result: dict) -> bytes:
    """The MP4 bytes of a successful result, from whichever store the replica used."""
    return _fetch(result["video_uri"], redis_url(), result.get("video_sha256"), SETTINGS.s3_endpoint_url)


def with_fresh_url(result: Result) -> Result:
    """A result as it is handed out: with S3, a presigned URL of its video made now (`video_url`, working until
    `video_url_expires_at`), not the replica's, which may have expired since."""
    return with_video_url(result, SETTINGS.s3_endpoint_url, SETTINGS.s3_url_ttl_s)


def remove_video(result: Result) -> None:
    """Remove a successful result's video and metadata from the output store that holds them."""
    delete_stored(result, redis_url(), SETTINGS.s3_endpoint_url)


def error_message(info) -> str:
    """'Type: message' from a FAILURE result (the backend hands back the exception rebuilt)."""
    if isinstance(info, BaseException):
        return f"{type(info).__name__}: {info}"
    return str(info)


def cancel_request(task_id: str) -> None:
    """Cancel a request: a queued one fails as RequestCancelled when a replica takes it, a running one at its
    next denoising step; the replica keeps its model either way. A request that has ended is left as it is."""
    client = app.backend.client

    def cancel() -> None:
        pipe = client.pipeline(transaction=False)
        pipe.set(keys.CANCEL_KEY + task_id, 1, ex=SETTINGS.result_ttl_s)
        pipe.publish(keys.CANCEL_CHANNEL, task_id)  # the replica running it hears it at once (replica.fences.FenceKeeper)
        pipe.execute()
    replication.durable(client, cancel, f"cancel of {task_id}", SETTINGS.durability)


def preempt_request(task_id: str, at_step: int = 1) -> None:
    """Preempt a running request: it stops at its next denoising step (or, if it has not reached `at_step` yet, at
    that step: to reproduce a preemption where it is wanted), its state is saved, and it goes back to the head of
    its priority list, to go on from that step on whichever replica takes it next, with the frames of a run never
    stopped (a fast-path request starts again instead). Past
    REPLICADP_MAX_PREEMPTIONS preemptions a request runs to its end; never at its last step. Asked of a request
    that has not started, it holds for a minute (cluster/preempt.ASK_S)."""
    client = app.backend.client
    replication.durable(client, lambda: preempt.ask(client, task_id, at_step), f"preemption of {task_id}",
                        SETTINGS.durability)


def run_requests(requests: Iterable[dict], concurrency: int = 0, timeout: float = 1800.0,
                 on_update: Callable[[list[InFlight], Outcome | None], None] | None = None) -> Iterator[Outcome]:
    """Submit `requests` keeping at most `concurrency` in flight (0: all at once), and yield each Outcome as
    its request completes. A request that fails or passes `timeout` seconds yields ok=False; the others go on.
    `on_update(in_flight, finished)` is called whenever a request is sent, or one in flight changes state, phase or
    step.
    Results arrive through the result waiter (results.py), not by polling."""
    check_redis()
    pending = list(enumerate(requests))
    pending.reverse()
    limit = concurrency if concurrency > 0 else len(pending)
    flying: dict[str, InFlight] = {}
    states: queue.Queue[tuple[str, dict]] = queue.Queue()
    watch = ResultWatch(app.backend, lambda task_id, meta: states.put((task_id, meta))).start()

    def settle(task_id: str, meta: dict | None, now: float) -> Outcome | None:
        """Record what a result says (None: nothing new); the Outcome if the request has ended."""
        entry = flying[task_id]
        out = entry.outcome
        status = meta["status"] if meta else entry.state
        info = meta.get("result") if meta else None
        if status == RequestState.SUCCESS:
            out.ok, out.result = True, with_fresh_url(info)
        elif status == RequestState.FAILURE:
            out.error = error_message(info)
        elif now - out.submitted_at > timeout:
            where = "still queued: is any replica live?" if status == RequestState.PENDING else status
            out.error = f"timed out after {timeout:.0f} s ({where})"
        else:
            if isinstance(info, dict) and (status, info.get("step", 0), info.get("phase")) != (
                    entry.state, entry.step, entry.phase):
                entry.step, entry.phase = info.get("step", entry.step), info.get("phase")
                entry.total_steps = info.get("total_steps", entry.total_steps)
                entry.replica = info.get("replica") or info.get("hostname") or entry.replica
                if on_update:
                    on_update(list(flying.values()), None)
            entry.state = status
            return None
        out.finished_at = now
        del flying[task_id]
        watch.unwatch(task_id)
        if on_update:
            on_update(list(flying.values()), out)
        return out

    try:
        while pending or flying:
            while pending and len(flying) < limit:
                index, request = pending.pop()
                task_id = str(uuid.uuid4())
                watch.watch(task_id)  # before sending: no state of it passes unseen
                flying[task_id] = InFlight(Outcome(index, request, task_id, time.time()))
                # Keep only the id: an AsyncResult would keep a pub/sub subscription whose messages nobody reads.
                try:
                    generate.apply_async(kwargs=request, task_id=task_id)
                except InvalidRequest as exc:  # refused before it was sent (its priority or user)
                    yield settle(task_id, {"status": RequestState.FAILURE, "result": exc}, time.time())
                else:
                    if on_update:  # sent: the caller learns its task id while it is queued
                        on_update(list(flying.values()), None)
            try:
                task_id, meta = states.get(timeout=SWEEP_S)
            except queue.Empty:
                task_id, meta = None, None
            now = time.time()
            if task_id in flying:
                done = settle(task_id, meta, now)
                if done:
                    yield done
            for task_id in [t for t, e in flying.items() if now - e.outcome.submitted_at > timeout]:
                yield settle(task_id, None, now)  # none came in time (Redis may be down)
    finally:
        watch.close()
