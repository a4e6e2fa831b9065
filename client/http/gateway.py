"""The gateway: what one gateway process knows of the cluster and does to it, for the routes.

It holds no state of its own: a job id is the Celery task id, a job's state is its result in the backend, and
the list of jobs lives in Redis (keys.JOBS_KEY, keys.JOB_KEY), so several gateways can serve side by side.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi import Request
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from replicadp_tasks import app as celery_app, generate
from replicadp_tasks.broker import queue_order, queue_order_call
from replicadp_tasks.cluster import connection, fleet
from replicadp_tasks.contract import (READY, Accepts, GenerateRequest, InvalidRequest, Priority, RequestState,
                                      check_priority, choose_model, keys, queue_for, queue_lists, validate_request)
from replicadp_tasks.outputs import poster_jpeg
from replicadp_tasks.settings import SETTINGS
from replicadp_tasks.webhooks import check_allowed

from ..api import cancel_request, fetch_video, live_replicas, redis_url, remove_video
from ..ops.status import accepted_by
from ..results import ResultWatch
from .admission import Admission
from .auth import KeyPolicy
from .errors import ErrorCode, GatewayError, invalid
from .form import VideoForm, generate_kwargs
from .schema import JobOrder

# The gateway's async Redis connections (everything but the result watch, which has Celery's backend's). A
# bounded pool that makes a request wait for a free connection: redis-py's default one fails past 100 in use.
REDIS_CONNECTIONS = 32
REDIS_WAIT_S = 20  # a request waits this long for one of them, then 503
# A pooled connection that Redis closed (a restart) fails its next command: it is retried this many times, each on
# a fresh connection (redis-py disconnects the failed one first), so a restart costs no request once Redis answers.
REDIS_RETRIES = 1
# And an idle connection is PINGed before use when it has been idle this long (s), which replaces a dead one first.
REDIS_HEALTH_CHECK_S = 5
# Where queued jobs wait: each list of the queue read once a second per gateway (the first QUEUE_SCAN messages of
# each: docs/http.md, `queue_position`, says what a read costs), whatever the number of jobs and pages polling; past
# that, a job has no position. A job queued since the last read has none until the next.
QUEUE_SCAN = 2000
QUEUE_ORDER_CACHE_S = 1.0
CANCEL_WATCH_POLL_S = 0.5  # how often a request deleted as it ran is checked until it ends (watch_cancelled)
CANCEL_THREADS = 4  # cancels run in this many threads, not one thread (and connection) per cancelled request
LIVE_CACHE_S = 1.0  # every request asks for the live replicas and the models (Redis reads): at most one a second
DISCONNECT_POLL_S = 1.0  # how often a sync request checks whether its client is still there (and the shutdown)
# A sync request handed over at shutdown: when its client should ask for the job (a restarted gateway serves
# within a few seconds of its start; the video takes what it takes).
HANDOVER_RETRY_AFTER_S = 5


@dataclass(frozen=True)
class Admitted:
    """A request validated and admitted, not yet sent."""

    task_id: str
    kwargs: dict  # generate's
    job: dict  # the job record's request fields (schema.VideoJob's): model, prompt, size, seconds, ...
    admitted_at: float = field(default_factory=time.time)  # a job's created_at, also for a sync request handed over



def validated(kwargs: dict, accepted: Accepts) -> GenerateRequest:
    """`kwargs` checked as the task will check them, against what the live replicas accept and this deployment's
    limits and webhook policy: InvalidRequest naming the field."""
    req = validate_request(kwargs, accepted, max_prompt_chars=SETTINGS.max_prompt_chars, max_work=SETTINGS.max_work)
    check_allowed(req.webhook)
    return req

class Refreshed:
    """A value that `read()` (a coroutine function) makes, reused while `max_age` seconds fresh and then read again
    in the background: a caller waits for a read only while there is no value yet, and one read runs at a time."""

    def __init__(self, read, max_age: float):
        self._read, self._max_age = read, max_age
        self._value = None
        self._read_at = 0.0
        self._reading: asyncio.Task | None = None

    async def _refresh(self) -> None:
        self._value = await self._read()
        self._read_at = time.monotonic()

    async def refresh(self) -> None:
        """Read it now (one read at a time: a read under way is waited for, not doubled)."""
        if self._reading is None or self._reading.done():
            self._reading = asyncio.create_task(self._refresh())
        await asyncio.shield(self._reading)

    async def get(self):
        stale = time.monotonic() - self._read_at > self._max_age
        if stale and (self._reading is None or self._reading.done()):
            self._reading = asyncio.create_task(self._refresh())
        if self._value is None:
            await asyncio.shield(self._reading)
        return self._value


class Gateway:
    """One per app (`app.state.gateway`). `max_queue`: requests waiting in a model's queue past which new ones for
    that model get 429; `sync_timeout`: seconds a sync request waits for its video before a 504. Started and closed
    by the app's lifespan, on its event loop."""

    def __init__(self, max_queue: int, sync_timeout: float):
        self.sync_timeout = sync_timeout
        self.redis = connection.async_client(
            redis_url(), REDIS_CONNECTIONS, timeout=REDIS_WAIT_S, retry=Retry(NoBackoff(), REDIS_RETRIES),
            health_check_interval=REDIS_HEALTH_CHECK_S)
        self.admission = Admission(self.redis, max_queue, SETTINGS.queue)
        # Not daemon threads: a cancel asked for at shutdown (a sync request cut short) still runs.
        self.cancels = ThreadPoolExecutor(CANCEL_THREADS, thread_name_prefix="cancel")
        self.results = ResultWatch(celery_app.backend, self._on_state)
        self._awaited: dict[str, asyncio.Future] = {}  # task id -> its final result meta, for run_sync
        self._loop: asyncio.AbstractEventLoop | None = None
        self._replicas = Refreshed(self._read_replicas, LIVE_CACHE_S)
        self._models = Refreshed(self._read_models, LIVE_CACHE_S)
        self._queue_order = Refreshed(self._read_queue_order, QUEUE_ORDER_CACHE_S)
        self._handover_at: float | None = None  # set by `stop`: when waiting sync requests are handed over as jobs
        self._watches: set[asyncio.Task] = set()  # watch_cancelled's

    def start(self) -> None:
        """On the event loop, which the result watch's thread hands final states over to."""
        self._loop = asyncio.get_running_loop()
        self.results.start()

    def stop(self, grace: float) -> None:
        """A graceful shutdown has begun (app.Server, on SIGTERM): sync requests still waiting `grace` seconds from
        now are handed over as jobs (`run_sync`). Only sets a time: it runs in a signal handler."""
        if self._handover_at is None:
            self._handover_at = time.monotonic() + grace

    async def close(self) -> None:
        for task in self._watches:
            task.cancel()
        await asyncio.to_thread(self.results.close)
        await self.redis.aclose()

    # --- the live replicas ---------------------------------------------------------------------------------

    async def _read_replicas(self) -> list[dict]:
        names = await asyncio.to_thread(live_replicas, 1.0, redis_url())
        raws = await self.redis.mget([keys.REPLICA_KEY + n for n in names]) if names else []
        return [{**(json.loads(raw) if raw else {}), "name": n} for n, raw in zip(names, raws)]

    async def replicas(self) -> list[dict]:
        """The live replicas and what each serves (their ReplicaInfo), at most LIVE_CACHE_S old."""
        return await self._replicas.get()

    async def _read_models(self) -> list[str]:
        # This gateway's REPLICADP_MODELS declared for every producer (a declaration that exists is left as it is),
        # then every declaration read: those among them.
        async with self.redis.pipeline(transaction=False) as pipe:
            for model in SETTINGS.models:
                pipe.hsetnx(keys.MODELS_KEY, model, fleet.declaration(model, SETTINGS.queue, "a gateway"))
            pipe.hgetall(keys.MODELS_KEY)
            return sorted(fleet.parse((await pipe.execute())[-1]))

    async def models(self, fresh: bool = False) -> list[str]:
        """The models this deployment serves (cluster/fleet.py), at most LIVE_CACHE_S old unless `fresh`."""
        if fresh:
            await self._models.refresh()
        return await self._models.get()

    async def choose_model(self, asked: str | None) -> str:
        """The model a request runs on (contract/models.choose_model), the models read again before a refusal:
        InvalidRequest naming `model` and the served ones."""
        try:
            return choose_model(asked, await self.models(), SETTINGS.default_model)
        except InvalidRequest:
            return choose_model(asked, await self.models(fresh=True), SETTINGS.default_model)

    async def queue_by_priority(self, model: str | None = None) -> dict[Priority, int]:
        """Requests waiting for `model` (None: for every model) at each priority, highest first."""
        served = [model] if model is not None else await self.models()
        pipe = self.redis.pipeline()
        for name in served:
            for key in queue_lists(queue_for(SETTINGS.queue, name)):
                pipe.llen(key)
        lengths = await pipe.execute()
        return {p: sum(lengths[i::len(Priority)]) for i, p in enumerate(Priority)}

    async def _read_queue_order(self) -> dict[str, int]:
        order = {}
        for model in await self.models():
            read = await self.redis.eval(*queue_order_call(queue_for(SETTINGS.queue, model), QUEUE_SCAN))
            ahead = 0
            for _, length, ids in queue_order(read):
                order.update({task_id: ahead + i + 1 for i, task_id in enumerate(ids) if task_id})
                ahead += length
        return order

    async def queue_positions(self) -> dict[str, int]:
        """Where queued requests wait, by task id: 1 for the next a replica of its model takes, counting every
        request queued for that model at a higher priority; at most QUEUE_ORDER_CACHE_S old."""
        return await self._queue_order.get()

    async def queue_depth(self, model: str | None = None) -> int:
        """Requests waiting for `model` (None: for every model), every priority."""
        return sum((await self.queue_by_priority(model)).values())

    # --- requests ------------------------------------------------------------------------------------------

    async def admit(self, form: VideoForm, key: KeyPolicy | None = None) -> Admitted:
        """Choose the model (400), validate as its replicas will (400), check the key's priority (403), and admit
        against the depth of the model's queue (429). The request goes as the key's tenant (its fairness lane, its
        webhook secret). Send what it admitted with `send` or `run_sync`."""
        try:
            model = await self.choose_model(form.model)
        except InvalidRequest as exc:
            raise GatewayError(400, str(exc), code=ErrorCode.MODEL_NOT_FOUND, param="model") from None
        # What every live replica of the model accepts (any of them may take it); the task checks again.
        accepted = accepted_by([r for r in await self.replicas() if r.get("model") == model])
        try:
            kwargs = {**generate_kwargs(form), "model": model}
            if key is not None:
                kwargs["tenant"] = key.owner
            # In a thread: a webhook's host is resolved to check its addresses (fetch.target), which may take
            # as long as the resolver does.
            req = await asyncio.to_thread(validated, kwargs, accepted)
        except InvalidRequest as exc:
            raise invalid(exc) from None
        asked = check_priority(kwargs.get("priority"))
        if key is not None and not key.allows(asked):
            raise GatewayError(403, f"priority={asked.value!r}: this API key may ask for {key.max_priority.value} at "
                                    f"most ({', '.join(p.value for p in Priority if key.allows(p))})",
                               code=ErrorCode.PRIORITY_NOT_ALLOWED, param="priority")
        task_id = str(uuid.uuid4())
        await self.admission.reserve(task_id, model)
        # OpenAI's and vllm-omni's `seconds` is whole seconds; num_frames and fps say the exact length.
        seconds = form.seconds if form.seconds is not None else max(1, round(req.num_frames / req.fps))
        # num_inference_steps: the page's estimate of when queued requests start reads their size (waits.plan).
        job = {"model": model, "prompt": req.prompt, "size": f"{req.width}x{req.height}",
               "seconds": str(seconds), "num_frames": req.num_frames, "fps": req.fps, "priority": asked.value,
               "num_inference_steps": req.num_inference_steps}
        return Admitted(task_id, kwargs, job)

    def _publish(self, admitted: Admitted) -> None:
        # The AsyncResult is dropped at once: alive, it would hold a pub/sub subscription of Celery's own.
        generate.apply_async(kwargs=admitted.kwargs, task_id=admitted.task_id)
        # Here in the thread, so that a send cancelled at shutdown still releases after its push. A failed
        # send leaves the reservation to expire.
        self.admission.release(admitted.task_id, admitted.kwargs["model"])

    async def send(self, admitted: Admitted) -> None:
        await asyncio.to_thread(self._publish, admitted)

    async def run_sync(self, admitted: Admitted, request: Request, owner: str | None) -> dict:
        """Send an admitted request and return its final result meta. If the client goes away or the sync timeout
        passes first, the request is cancelled: nobody would collect its video. If the gateway is stopping and
        the grace (`stop`) passes first, the request goes on as a job of `owner`, answered 503 with its id (a
        video the client can still collect; uvicorn, left to itself, would cancel it and answer 500)."""
        task_id = admitted.task_id
        future = self._loop.create_future()
        self._awaited[task_id] = future
        self.results.watch(task_id)  # before sending: no result can come unseen
        settled = False  # ended, or handed over as a job: not to be cancelled
        try:
            await self.send(admitted)
            deadline = time.monotonic() + self.sync_timeout
            while True:
                now = time.monotonic()
                if now >= deadline:
                    raise GatewayError(504, f"no result after {self.sync_timeout:g} s (is any replica live?); the "
                                            "request was cancelled", code=ErrorCode.TIMEOUT)
                if self._handover_at is not None and now >= self._handover_at:
                    await self.add_job(admitted, owner)
                    settled = True
                    raise GatewayError(503, f"the gateway is shutting down; the request goes on as video job "
                                            f"{task_id}: GET /v1/videos/{task_id} for its status, "
                                            f"GET /v1/videos/{task_id}/content for the MP4 once it is completed",
                                       code=ErrorCode.SHUTTING_DOWN,
                                       headers={"Retry-After": str(HANDOVER_RETRY_AFTER_S), "X-Request-Id": task_id})
                until = min(deadline, self._handover_at or deadline)
                done, _ = await asyncio.wait({future}, timeout=min(until - now, DISCONNECT_POLL_S))
                if done:
                    settled = True
                    return future.result()
                if await request.is_disconnected():
                    raise GatewayError(499, "client closed the connection; the request was cancelled",
                                       code=ErrorCode.CLIENT_CLOSED)
        finally:
            self.results.unwatch(task_id)
            del self._awaited[task_id]
            if not settled:
                # Even if the send failed or was cut short: cancelling a request never sent does no harm.
                self.cancels.submit(cancel_request, task_id)

    def _on_state(self, task_id: str, meta: dict) -> None:
        """From the result watch's thread: hand a final state over to the event loop."""
        if meta["status"] in READY:
            self._loop.call_soon_threadsafe(self._settle, task_id, meta)

    def _settle(self, task_id: str, meta: dict) -> None:
        future = self._awaited.get(task_id)
        if future is not None and not future.done():  # the same state may come twice
            future.set_result(meta)

    # --- jobs (async requests) -----------------------------------------------------------------------------

    async def add_job(self, admitted: Admitted, owner: str | None) -> dict:
        """Record an admitted request as a job of `owner` (its API key's id, None without keys), before it is sent
        (a GET right after the POST finds it), or a sync request handed over at shutdown; returns the job record."""
        now = admitted.admitted_at
        record = {"id": admitted.task_id, "created_at": int(now), "admitted_at": now, **admitted.job, "owner": owner}
        async with self.redis.pipeline() as pipe:
            pipe.set(keys.JOB_KEY + admitted.task_id, json.dumps(record), ex=SETTINGS.result_ttl_s)
            for key in {keys.JOBS_KEY, jobs_of(owner)}:
                pipe.zadd(key, {admitted.task_id: now})
                pipe.zremrangebyscore(key, 0, now - SETTINGS.result_ttl_s)
            await pipe.execute()
        return record

    async def mark_cancelled(self, record: dict) -> dict:
        """Keep a job deleted while it runs readable until its request ends (job_view: `cancelling`, then
        cancelled), and no longer listed; returns its record as marked."""
        marked = {**record, "cancelled_at": time.time()}
        async with self.redis.pipeline() as pipe:
            pipe.set(keys.JOB_KEY + record["id"], json.dumps(marked), ex=SETTINGS.result_ttl_s)
            for key in {keys.JOBS_KEY, jobs_of(record.get("owner"))}:
                pipe.zrem(key, record["id"])
            await pipe.execute()
        return marked

    def watch_cancelled(self, video_id: str) -> None:
        """Watch a running request deleted: if it stores its video all the same (the cancel came as it stored),
        remove it once its result says so. The replica checks for a cancel before and after it stores; this
        covers a cancel that came between its check and its result."""
        task = asyncio.create_task(self._remove_if_stored(video_id))
        self._watches.add(task)
        task.add_done_callback(self._watches.discard)

    async def _remove_if_stored(self, video_id: str) -> None:
        key = celery_app.backend.get_key_for_task(video_id)
        deadline = time.monotonic() + SETTINGS.time_limit_s  # a request ends by its hard time limit
        while time.monotonic() < deadline:
            raw = await self.redis.get(key)
            meta = celery_app.backend.decode_result(raw) if raw else None
            if meta and meta["status"] in READY:
                if meta["status"] == RequestState.SUCCESS:
                    await asyncio.to_thread(remove_video, meta["result"])
                return
            await asyncio.sleep(CANCEL_WATCH_POLL_S)

    async def poster(self, video_id: str, result: dict, longest: int) -> bytes:
        """The JPEG of a completed job's first frame (video.poster_jpeg), made once and kept with the job."""
        kept = await self.redis.get(keys.POSTER_KEY + video_id)
        if kept is not None:
            return kept
        video = await asyncio.to_thread(fetch_video, result)
        poster = await asyncio.to_thread(poster_jpeg, video, longest)
        await self.redis.set(keys.POSTER_KEY + video_id, poster, ex=SETTINGS.result_ttl_s)
        return poster

    async def forget(self, record: dict) -> None:
        async with self.redis.pipeline() as pipe:
            pipe.delete(keys.JOB_KEY + record["id"], keys.POSTER_KEY + record["id"])
            for key in {keys.JOBS_KEY, jobs_of(record.get("owner"))}:
                pipe.zrem(key, record["id"])
            await pipe.execute()

    async def job_ids(self, limit: int, after: str | None, order: JobOrder, owner: str | None) -> list[str]:
        """Up to `limit` + 1 ids of `owner`'s jobs (None: the keyless ones) in creation order (`desc`: newest
        first), from the one after `after`: the one past the page says whether there is more."""
        jobs, start = jobs_of(owner), 0
        if after is not None:
            rank = await (self.redis.zrevrank if order == "desc" else self.redis.zrank)(jobs, after)
            if rank is None:
                raise GatewayError(400, f"after={after!r}: no such video job", code=ErrorCode.INVALID_REQUEST,
                                   param="after")
            start = rank + 1
        read = self.redis.zrevrange if order == "desc" else self.redis.zrange
        return [i.decode() for i in await read(jobs, start, start + limit)]

    async def job_records(self, ids: list[str]) -> list[tuple[dict, dict | None]]:
        """(record, result meta) of each job that still has a record."""
        if not ids:
            return []
        backend = celery_app.backend
        records = await self.redis.mget([keys.JOB_KEY + i for i in ids])
        metas = await self.redis.mget([backend.get_key_for_task(i) for i in ids])
        return [(json.loads(rec), backend.decode_result(meta) if meta else None)
                for rec, meta in zip(records, metas) if rec]

    async def job(self, video_id: str, owner: str | None) -> tuple[dict, dict | None]:
        """(record, result meta) of one job; 404 without a record, or when another owner made it (another API
        key's, or a keyed job asked for without a key, or the other way round), as if it did not exist: a key
        learns nothing of the others' jobs, nor a keyless gateway on the same Redis of the keyed ones."""
        found = await self.job_records([video_id])
        if not found or found[0][0].get("owner") != owner:
            raise GatewayError(404, f"video_id={video_id!r}: no such video job (unknown, deleted, or older than "
                                    f"REPLICADP_RESULT_TTL={SETTINGS.result_ttl_s} s)", code=ErrorCode.NOT_FOUND,
                               param="video_id")
        return found[0]


def jobs_of(owner: str | None) -> str:
    """The sorted set of `owner`'s jobs; None: those made without an API key (a set of their own, not keys.JOBS_KEY,
    every job's, and no name an owner's set can have)."""
    return f"{keys.JOBS_KEY}-keyless" if owner is None else f"{keys.JOBS_KEY}:{owner}"
