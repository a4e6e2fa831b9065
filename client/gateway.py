"""The HTTP front door (`replicadp serve-http`): vllm-omni's video API in front of the replicas.

Each HTTP request becomes exactly one `generate` task on the shared queue. The gateway holds no model and no
GPU (it never imports torch), and no state of its own: a job id is the Celery task id, a job's state is its
result in the backend, and the list of jobs lives in Redis, so several gateways can serve side by side.
See docs/http.md.
"""

from __future__ import annotations

import asyncio
import base64
import codecs
import inspect
import json
import math
import re
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from datetime import datetime
from urllib.parse import unquote_to_bytes
from typing import Annotated, Literal

import redis.asyncio as aioredis
from celery import states
from fastapi import Depends, FastAPI, File, Form, Query, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from kombu.exceptions import OperationalError
from pydantic import BaseModel
from python_multipart import MultipartParser, QuerystringParser
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import parse_options_header
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException

from replicadp_tasks import app as celery_app
from replicadp_tasks import generate
from replicadp_tasks.errors import InvalidRequest, StoreError
from replicadp_tasks.settings import SETTINGS
from replicadp_tasks.validate import DEFAULTS, MAX_FPS, MAX_FRAMES, validate_request
from replicadp_tasks.worker import COMPLETED_KEY, REPLICA_KEY

from .api import cancel_request, fetch_video, live_replicas, redis_url

JOBS_KEY = "replicadp:http:jobs"  # sorted set: job id -> creation time, shared by every gateway
JOB_KEY = "replicadp:http:job:"  # + job id: the job's request as created (JSON), kept REPLICADP_RESULT_TTL
# + queue name: sorted set, task id -> admission time (Redis's clock), of the requests admitted by any gateway and
# not yet in the queue. See ADMIT.
ADMITTING_KEY = "replicadp:http:admitting:"
# A reservation older than this is dropped: its gateway died (or lost Redis) between admitting and sending. Above
# the ~30 s a send rides out a Redis restart for (celeryconfig's task_publish_retry_policy).
ADMIT_STALE_S = 60
# The gateway's async Redis connections, the result watch's pub/sub among them. A bounded pool that makes a
# request wait for a free connection: redis-py's default pool (100) raises "Too many connections" instead, which
# a burst of 200 requests turned into 101 answers of 503.
REDIS_CONNECTIONS = 32
REDIS_WAIT_S = 20  # a request waits this long for one of them, then 503
CANCEL_THREADS = 4  # cancels run in this many threads, not one thread (and connection) per cancelled request
LIVE_CACHE_S = 2.0  # a Celery broadcast takes ~1 s: reuse the live replicas for this long
SWEEP_S = 1.0  # results in flight are read in full this often, besides the pub/sub notifications
DISCONNECT_POLL_S = 1.0  # how often a sync request checks whether its client is still there
THROUGHPUT_WINDOW_S = 300  # completions over this window estimate Retry-After
RETRY_AFTER_UNKNOWN_S = 10  # Retry-After when nothing completed lately (no rate to estimate from)
FORM_ALLOWANCE = 1024 * 1024  # a body may exceed the image limit by this (text fields, multipart framing)
SIZE_RE = re.compile(r"([0-9]+)x([0-9]+)")
# The field an InvalidRequest names: "width=48: ...", "image: ...", "height x width x ...=...: ...".
FIELD_RE = re.compile(r"([a-z_]+(?: x [a-z_]+)*)[=:]")
HTTP_NAMES = {"image": "input_reference"}  # generate's argument -> the form field it comes from


# --- response bodies (also the OpenAPI schema) ------------------------------------------------------------

class VideoError(BaseModel):
    code: str
    message: str


class VideoJob(BaseModel):
    """OpenAI's and vllm-omni's video job object, plus what the replica reported."""

    id: str
    object: Literal["video"] = "video"
    model: str
    status: Literal["queued", "in_progress", "completed", "failed"]
    progress: int
    created_at: int
    completed_at: int | None = None
    size: str
    seconds: str
    num_frames: int
    fps: int
    prompt: str
    error: VideoError | None = None
    replica: str | None = None
    inference_time_s: float | None = None
    media_type: Literal["video/mp4"] = "video/mp4"


class VideoList(BaseModel):
    object: Literal["list"] = "list"
    data: list[VideoJob]
    first_id: str | None
    last_id: str | None
    has_more: bool


class VideoDeleted(BaseModel):
    id: str
    object: Literal["video.deleted"] = "video.deleted"
    deleted: bool


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "replicadp"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok", "unavailable"]
    replicas: list[str]
    queue_depth: int


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str


class ErrorBody(BaseModel):
    error: ErrorDetail


ERRORS = {code: {"model": ErrorBody} for code in (400, 404, 409, 413, 422, 429, 502, 503, 504)}


# --- errors ------------------------------------------------------------------------------------------------

class GatewayError(HTTPException):
    """An error answered as OpenAI's error object. An HTTPException, so that one raised while FastAPI reads the
    body (the body limit) keeps its status."""

    def __init__(self, status: int, message: str, *, code: str, param: str | None = None, headers=None):
        super().__init__(status, message, headers)
        self.code, self.param = code, param


def invalid(exc: InvalidRequest) -> GatewayError:
    """400 naming the field that generate's validation (here or in the task) refused."""
    message = str(exc)
    match = FIELD_RE.match(message)
    field = match.group(1) if match else None
    if field in HTTP_NAMES:
        field = HTTP_NAMES[field]
        message = field + message[len(match.group(1)):]
    return GatewayError(400, message, code="invalid_request", param=field)


def error_body(status: int, message: str, code: str, param: str | None) -> dict:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def too_large(limit: int) -> GatewayError:
    return GatewayError(413, f"input_reference: request body over {limit} bytes; a first frame may have at most "
                             f"{SETTINGS.max_image_bytes} bytes (REPLICADP_MAX_IMAGE_BYTES)",
                        code="too_large", param="input_reference")


def not_utf8(field: bytes, exc: UnicodeDecodeError, offset: int) -> GatewayError:
    name = field.decode(errors="backslashreplace")
    return GatewayError(400, f"{name}: not UTF-8 (byte 0x{exc.object[exc.start]:02x} at offset {offset} of the "
                             "value); form values must be UTF-8", code="invalid_request", param=name)


class FormText:
    """The form's field names and text values, checked as UTF-8 from the raw body as it arrives, beside
    Starlette's own parser: Starlette decodes a multipart value that is not UTF-8 as Latin-1, and an urlencoded
    one with U+FFFD in place of the bad bytes, without a word, so the decoded form cannot tell. `feed` raises
    a 400 naming the first field that is not UTF-8. File parts are not checked (nor kept)."""

    def __init__(self, content_type: bytes):
        kind, params = parse_options_header(content_type)
        self.parser = None
        if kind not in (b"multipart/form-data", b"application/x-www-form-urlencoded"):
            return  # no form: Starlette reads none either
        charset = params.get(b"charset", b"utf-8").decode("latin-1")
        try:
            charset_ok = codecs.lookup(charset).name == "utf-8"
        except LookupError:
            charset_ok = False
        if not charset_ok:
            raise GatewayError(400, f"Content-Type: charset={charset!r}; form values must be UTF-8",
                               code="invalid_request")
        try:
            if kind == b"multipart/form-data" and b"boundary" in params:
                self.parser = MultipartParser(params[b"boundary"], {
                    "on_part_begin": self._begin, "on_header_field": self._header_field,
                    "on_header_value": self._header_value, "on_header_end": self._header_end,
                    "on_headers_finished": self._headers_finished, "on_part_data": self._part_data,
                    "on_part_end": self._part_end})
            elif kind == b"application/x-www-form-urlencoded":
                self.parser = QuerystringParser({"on_field_start": self._begin, "on_field_name": self._field_name,
                                                 "on_field_data": self._field_data, "on_field_end": self._field_end})
        except FormParserError:  # malformed (here and in feed): Starlette's parser refuses it with its own 400
            self.parser = None

    def feed(self, chunk: bytes) -> None:
        if self.parser is not None and chunk:
            try:
                self.parser.write(chunk)
            except FormParserError:
                self.parser = None

    def _begin(self) -> None:
        self.name, self.header, self.value, self.disposition, self.raw = b"", b"", b"", b"", bytearray()
        self.decoder, self.seen = codecs.getincrementaldecoder("utf-8")(), 0

    # multipart: a part's Content-Disposition names it (and says whether it is a file); its text is decoded
    # incrementally, so a value is never held whole. A header may arrive in pieces.
    def _header_field(self, data, start, end) -> None:
        self.header += data[start:end]

    def _header_value(self, data, start, end) -> None:
        self.value += data[start:end]

    def _header_end(self) -> None:
        if self.header.lower() == b"content-disposition":
            self.disposition = self.value
        self.header, self.value = b"", b""

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self.disposition)
        self.name = options.get(b"name", b"")
        self._check_name()
        if b"filename" in options:
            self.decoder = None

    def _part_data(self, data, start, end) -> None:
        if self.decoder is not None:
            self._decode(bytes(data[start:end]), final=False)

    def _part_end(self) -> None:
        if self.decoder is not None:
            self._decode(b"", final=True)

    def _decode(self, data: bytes, final: bool) -> None:
        pending = len(self.decoder.getstate()[0])
        try:
            self.decoder.decode(data, final)
        except UnicodeDecodeError as exc:
            raise not_utf8(self.name, exc, self.seen - pending + exc.start) from None
        self.seen += len(data)

    # urlencoded: percent-escapes may straddle chunks, so a field is decoded once it ends.
    def _field_name(self, data, start, end) -> None:
        self.name += data[start:end]

    def _field_data(self, data, start, end) -> None:
        self.raw += data[start:end]

    def _field_end(self) -> None:
        self.name = self._unquote(self.name, b"")
        self._check_name()
        try:
            self._unquote(bytes(self.raw), self.name).decode()
        except UnicodeDecodeError as exc:
            raise not_utf8(self.name, exc, exc.start) from None

    def _unquote(self, raw: bytes, field: bytes) -> bytes:
        if not raw.isascii():  # Starlette would read the raw bytes as Latin-1, even valid UTF-8
            name = field.decode(errors="backslashreplace") if field else None
            raise GatewayError(400, f"{name or 'a field name'}: bytes past ASCII in an urlencoded form; "
                                    "percent-encode them (%C3%A9) or send multipart/form-data",
                               code="invalid_request", param=name)
        return unquote_to_bytes(raw.replace(b"+", b" "))

    def _check_name(self) -> None:
        try:
            self.name.decode()
        except UnicodeDecodeError as exc:
            raise GatewayError(400, f"field name {self.name!r}: not UTF-8 (byte 0x{exc.object[exc.start]:02x} at "
                                    f"offset {exc.start}); form field names must be UTF-8", code="invalid_request",
                               param=self.name.decode(errors="backslashreplace")) from None


class BodyCheck:
    """Refuse a request body past `limit` bytes while it arrives: Starlette would spool an upload of any size
    to a temporary file before the endpoint could look at it. And check a form's text as it arrives
    (FormText)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            err = too_large(self.limit)
            response = JSONResponse(error_body(413, err.detail, err.code, err.param), status_code=413)
            return await response(scope, receive, send)
        seen = 0
        form = None

        async def checked():
            nonlocal seen, form
            message = await receive()
            body = message.get("body", b"")
            seen += len(body)
            if seen > self.limit:  # a chunked body, which declares no length
                raise too_large(self.limit)
            if form is None:  # read by the endpoint: a form route
                form = FormText(headers.get(b"content-type", b""))
            form.feed(body)
            return message

        await self.app(scope, checked, send)


# --- the form ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class VideoForm:
    prompt: str
    size: str | None
    width: int | None
    height: int | None
    num_frames: int | None
    seconds: int | None
    fps: int | None
    num_inference_steps: int | None
    guidance_scale: float | None
    seed: int | None
    negative_prompt: str | None
    model: str | None
    image: str | None  # input_reference, base64


async def video_form(
    request: Request,
    prompt: Annotated[str, Form(description="What the video shows.")],
    size: Annotated[str | None, Form(description="WIDTHxHEIGHT, e.g. 832x480; or width and height.")] = None,
    width: Annotated[int | None, Form(description="Pixels; a multiple of the model's size multiple.")] = None,
    height: Annotated[int | None, Form()] = None,
    num_frames: Annotated[int | None, Form(description="Of the form 4k+1.")] = None,
    seconds: Annotated[int | None, Form(description="Without num_frames: seconds x fps + 1 frames.")] = None,
    fps: Annotated[int | None, Form(description="Frame rate of the MP4 (default 24).")] = None,
    num_inference_steps: Annotated[int | None, Form()] = None,
    guidance_scale: Annotated[float | None, Form()] = None,
    seed: Annotated[int | None, Form()] = None,
    negative_prompt: Annotated[str | None, Form()] = None,
    model: Annotated[str | None, Form(description="Must be the served model, if given.")] = None,
    input_reference: Annotated[UploadFile | None, File(description="First frame (TI2V): an image file.")] = None,
) -> VideoForm:
    # A field this gateway does not know (vllm-omni's flow_shift, boundary_ratio, lora...) would be silently
    # ignored, giving another video than the one asked for: refuse it, as generate refuses unknown arguments.
    counts = Counter(name for name, _ in (await request.form()).multi_items())
    unknown = sorted(set(counts) - set(FORM_FIELDS))
    if unknown:
        raise GatewayError(400, f"{unknown[0]}: unknown field; accepted: {', '.join(FORM_FIELDS)}",
                           code="invalid_request", param=unknown[0])
    # A field given twice would silently take its last value (FastAPI's reading): which one was meant?
    repeated = sorted(name for name, n in counts.items() if n > 1)
    if repeated:
        raise GatewayError(400, f"{repeated[0]}: given {counts[repeated[0]]} times; give each field once",
                           code="invalid_request", param=repeated[0])
    image = None
    if input_reference is not None:
        data = await input_reference.read(SETTINGS.max_image_bytes + 1)
        if len(data) > SETTINGS.max_image_bytes:
            raise GatewayError(413, f"input_reference: more than {SETTINGS.max_image_bytes} bytes "
                                    "(REPLICADP_MAX_IMAGE_BYTES)", code="too_large", param="input_reference")
        if not data:
            raise GatewayError(400, "input_reference: empty file", code="invalid_request", param="input_reference")
        image = base64.b64encode(data).decode()
    return VideoForm(prompt=prompt, size=size, width=width, height=height, num_frames=num_frames, seconds=seconds,
                     fps=fps, num_inference_steps=num_inference_steps, guidance_scale=guidance_scale, seed=seed,
                     negative_prompt=negative_prompt, model=model, image=image)


FORM_FIELDS = [name for name in inspect.signature(video_form).parameters if name != "request"]


def generate_kwargs(form: VideoForm) -> dict:
    """The form as generate's keyword arguments: size into width and height, seconds into num_frames."""
    width, height = form.width, form.height
    if form.size is not None:
        match = SIZE_RE.fullmatch(form.size)
        if not match:
            raise InvalidRequest(f"size={form.size!r}: expected WIDTHxHEIGHT, e.g. 832x480")
        for name, given, parsed in (("width", width, int(match[1])), ("height", height, int(match[2]))):
            if given is not None and given != parsed:
                raise InvalidRequest(f"size={form.size!r}: conflicts with {name}={given}")
        width, height = int(match[1]), int(match[2])
    num_frames = form.num_frames
    fps = form.fps if form.fps is not None else DEFAULTS["fps"]
    if num_frames is None and form.seconds is not None and 1 <= fps <= MAX_FPS:  # else validation names fps
        # Wan counts both ends: 5 s at 24 fps is 121 frames, at 16 fps 81. seconds x fps alone is never of
        # the form 4k+1 at a frame rate divisible by 4, and frames are never rounded here.
        num_frames = form.seconds * fps + 1
        if form.seconds < 1:
            raise InvalidRequest(f"seconds={form.seconds}: must be at least 1")
        if (num_frames - 1) % 4 or num_frames > MAX_FRAMES:
            raise InvalidRequest(f"seconds={form.seconds}: at fps={fps} that is {num_frames} frames (seconds x fps "
                                 f"+ 1), which must be of the form 4k+1 and at most {MAX_FRAMES}; or pass num_frames")
    kwargs = {"prompt": form.prompt, "negative_prompt": form.negative_prompt, "seed": form.seed, "height": height,
              "width": width, "num_frames": num_frames, "num_inference_steps": form.num_inference_steps,
              "guidance_scale": form.guidance_scale, "fps": form.fps, "image": form.image}
    return {k: v for k, v in kwargs.items() if v is not None}


# --- results and job state ---------------------------------------------------------------------------------

class ResultWatch:
    """Every result the backend stores, from one pub/sub connection per gateway (a pattern subscription, so
    no per-request subscribe), handed to the sync requests waiting on it. A full read of every awaited
    result each SWEEP_S catches what pub/sub missed (a reconnect)."""

    def __init__(self, client: aioredis.Redis):
        self.client, self.backend = client, celery_app.backend
        self.waiting: dict[bytes, asyncio.Future] = {}

    def watch(self, task_id: str) -> asyncio.Future:
        """A future for the task's final result meta; call before sending it, so that none is missed."""
        future = asyncio.get_running_loop().create_future()
        self.waiting[self.backend.get_key_for_task(task_id)] = future
        return future

    def unwatch(self, task_id: str) -> None:
        self.waiting.pop(self.backend.get_key_for_task(task_id), None)

    def _settle(self, key: bytes, raw) -> None:
        future = self.waiting.get(key)
        if raw is None or future is None or future.done():
            return
        try:
            meta = self.backend.decode_result(raw)
        except Exception as exc:  # noqa: BLE001 (the request waiting on it answers the error; the watch goes on)
            future.set_exception(exc)
            return
        if meta["status"] in states.READY_STATES:
            future.set_result(meta)

    async def _sweep(self) -> None:
        keys = list(self.waiting)
        if keys:
            for key, raw in zip(keys, await self.client.mget(keys)):
                self._settle(key, raw)

    async def run(self) -> None:
        while True:
            pubsub = self.client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.psubscribe(self.backend.get_key_for_task("*"))
                await self._sweep()  # what completed while we were not subscribed
                swept = time.monotonic()
                while True:
                    message = await pubsub.get_message(timeout=SWEEP_S)
                    if message is not None:
                        self._settle(message["channel"], message["data"])
                    if time.monotonic() - swept >= SWEEP_S:
                        await self._sweep()
                        swept = time.monotonic()
            except (RedisError, OSError):  # Redis restarting: resubscribe and catch up
                await asyncio.sleep(0.5)
            finally:
                await pubsub.aclose()


# Failure classes -> (HTTP status of a sync request, job error code). A replica-side failure is a 502 (the
# gateway worked, its upstream did not), so that a 500 always means a fault in the gateway itself.
FAILURES = {"RequestCancelled": (409, "cancelled"), "TaskRevokedError": (409, "cancelled"),
            "SoftTimeLimitExceeded": (504, "timeout"), "TimeLimitExceeded": (504, "timeout")}


def failure(meta: dict) -> GatewayError:
    """What a failed task means to an HTTP client: its status for a sync request, its code for a job."""
    exc = meta["result"]
    if isinstance(exc, InvalidRequest):
        return invalid(exc)
    status, code = FAILURES.get(type(exc).__name__, (502, "generation_failed"))
    return GatewayError(status, f"{type(exc).__name__}: {exc}", code=code)


def date_done(meta: dict) -> int | None:
    done = meta.get("date_done")
    return int(datetime.fromisoformat(done).timestamp()) if isinstance(done, str) else None


def job_view(record: dict, meta: dict | None) -> VideoJob:
    """A job as the API shows it: its request as created, its state from the result backend. A cancelled
    job is `failed` with error code `cancelled`: the four states are what OpenAI's and vllm-omni's clients
    know."""
    job = VideoJob(status="queued", progress=0, **record)
    status = meta["status"] if meta else states.PENDING
    info = meta.get("result") if meta else None
    if status == states.SUCCESS:
        job.status, job.progress, job.completed_at = "completed", 100, date_done(meta)
        job.replica, job.inference_time_s = info["replica"], info["timings"]["inference_s"]
    elif status in states.READY_STATES:
        error = failure(meta)
        job.status, job.completed_at = "failed", date_done(meta)
        job.error = VideoError(code=error.code, message=error.detail)
    elif status in (states.STARTED, "PROGRESS"):
        job.status = "in_progress"
        if isinstance(info, dict):
            job.replica = info.get("replica") or info.get("hostname")
            if info.get("total_steps"):  # 100 only once the video is stored
                job.progress = min(99, 100 * info["step"] // info["total_steps"])
    return job


def video_response(meta: dict, video: bytes) -> Response:
    """The MP4 bytes exactly as the replica stored them (bit-exact encoding: the same input gives the same
    bytes on any replica), with vllm-omni's headers."""
    return Response(video, media_type="video/mp4", headers={
        "X-Request-Id": meta["request_id"], "X-Model": meta["model"], "X-Replica": meta["replica"],
        "X-Inference-Time-S": str(meta["timings"]["inference_s"])})


# --- the gateway -------------------------------------------------------------------------------------------

# Admission, atomic in Redis across every gateway: a request is admitted while the queue (LLEN) plus the requests
# admitted and not yet in it (ADMITTING_KEY, any gateway's) is under the limit, and is then counted by its
# reservation until its send has pushed it. Reading LLEN and sending apart let a burst of 200 through a limit of 5
# (97 queued): every request read the depth before any was sent. A Redis lock around read-and-send would
# serialise every gateway's sends and make requests poll for it; pushing Celery's message from the script would
# mean building kombu's envelope ourselves. Here nothing waits, and the only cost is counting a request twice for
# the moment between its push and its release: at worst a 429 a moment early, never a queue over the limit.
# KEYS: the queue, the reservations; ARGV: the limit, the task id, ADMIT_STALE_S. Returns {admitted, depth}.
ADMIT = """
local now = redis.call('TIME')
now = tonumber(now[1]) + tonumber(now[2]) / 1e6
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - tonumber(ARGV[3]))
local depth = redis.call('LLEN', KEYS[1]) + redis.call('ZCARD', KEYS[2])
if depth >= tonumber(ARGV[1]) then
  return {0, depth}
end
redis.call('ZADD', KEYS[2], now, ARGV[2])
redis.call('EXPIRE', KEYS[2], ARGV[3])
return {1, depth}
"""


class Gateway:
    def __init__(self, max_queue: int, sync_timeout: float):
        self.max_queue, self.sync_timeout = max_queue, sync_timeout
        self.redis = aioredis.Redis.from_pool(aioredis.BlockingConnectionPool.from_url(
            redis_url(), max_connections=REDIS_CONNECTIONS, timeout=REDIS_WAIT_S))
        self.admission = self.redis.register_script(ADMIT)
        self.admitting = ADMITTING_KEY + SETTINGS.queue
        # Not daemon threads: a cancel asked for at shutdown (a sync request cut short) still runs.
        self.cancels = ThreadPoolExecutor(CANCEL_THREADS, thread_name_prefix="cancel")
        self.results = ResultWatch(self.redis)
        self._replicas: list[dict] | None = None
        self._refreshed = 0.0
        self._refresh: asyncio.Task | None = None

    async def _read_replicas(self) -> None:
        names = await asyncio.to_thread(live_replicas, 1.0, redis_url())
        raws = await self.redis.mget([REPLICA_KEY + n for n in names]) if names else []
        self._replicas = [{**(json.loads(raw) if raw else {}), "name": n} for n, raw in zip(names, raws)]
        self._refreshed = time.monotonic()

    async def replicas(self) -> list[dict]:
        """The live replicas and what each serves. Refreshed in the background once LIVE_CACHE_S old, so a
        request waits for the broadcast only when the gateway has none yet."""
        stale = time.monotonic() - self._refreshed > LIVE_CACHE_S
        if stale and (self._refresh is None or self._refresh.done()):
            self._refresh = asyncio.create_task(self._read_replicas())
        if self._replicas is None:
            await asyncio.shield(self._refresh)
        return self._replicas

    async def served_models(self) -> list[str]:
        """What the live replicas serve; with none live, REPLICADP_MODEL (the deployment's model)."""
        return sorted({r["model"] for r in await self.replicas() if r.get("model")}) or [SETTINGS.model]

    async def admit(self, form: VideoForm) -> tuple[str, dict, dict]:
        """Validate as the task will (400), check the model (400) and admit against the queue depth (429, see
        ADMIT); returns the task id it admitted, generate's kwargs and the job record. Send it with `send`."""
        live = await self.replicas()
        # 16 (Wan's smallest) unless the replicas publish their model's multiple; the task checks again anyway.
        multiple = max((int(r.get("size_multiple") or 16) for r in live), default=16)
        try:
            kwargs = generate_kwargs(form)
            req = validate_request(kwargs, size_multiple=multiple, max_prompt_chars=SETTINGS.max_prompt_chars,
                                   max_work=SETTINGS.max_work)
        except InvalidRequest as exc:
            raise invalid(exc) from None
        served = await self.served_models()
        if form.model is not None and form.model not in served:
            raise GatewayError(400, f"model={form.model!r}: this gateway serves {', '.join(served)}",
                               code="model_not_found", param="model")
        task_id = str(uuid.uuid4())
        admitted, depth = await self.admission(keys=[SETTINGS.queue, self.admitting],
                                               args=[self.max_queue, task_id, ADMIT_STALE_S])
        if not admitted:
            wait = await self.retry_after(depth)
            raise GatewayError(429, f"{depth} requests are waiting (the limit is {self.max_queue}); retry in about "
                                    f"{wait} s", code="queue_full", headers={"Retry-After": str(wait)})
        seconds = form.seconds if form.seconds is not None else f"{req.num_frames / req.fps:g}"
        record = {"model": form.model or served[0], "prompt": req.prompt, "size": f"{req.width}x{req.height}",
                  "seconds": str(seconds), "num_frames": req.num_frames, "fps": req.fps}
        return task_id, kwargs, record

    async def retry_after(self, depth: int) -> int:
        """Seconds until the queue is likely below the limit again: the requests past it over the cluster's
        completion rate of the last THROUGHPUT_WINDOW_S (every replica's, not only this gateway's)."""
        now = time.time()
        done = await self.redis.zcount(COMPLETED_KEY, now - THROUGHPUT_WINDOW_S, now)
        if not done:
            return RETRY_AFTER_UNKNOWN_S
        return max(1, math.ceil((depth - self.max_queue + 1) * THROUGHPUT_WINDOW_S / done))

    def _publish(self, task_id: str, kwargs: dict) -> None:
        # The AsyncResult is dropped at once: alive, it would hold a pub/sub subscription of Celery's own.
        generate.apply_async(kwargs=kwargs, task_id=task_id)
        # Released once the queue holds the request (until then its reservation counts it), here in the thread,
        # so that a send whose request was cancelled at shutdown still releases it after its push. A failed
        # send, or a failed release, leaves the reservation to expire after ADMIT_STALE_S.
        with suppress(RedisError):
            celery_app.backend.client.zrem(self.admitting, task_id)

    async def send(self, task_id: str, kwargs: dict) -> None:
        """Send the task that `admit` admitted."""
        await asyncio.to_thread(self._publish, task_id, kwargs)

    async def run_sync(self, task_id: str, kwargs: dict, request: Request) -> dict:
        """Send one admitted task and return its final result meta. If the client goes away, the sync timeout
        passes or the gateway stops first, the task is cancelled: nobody would collect its video."""
        future = self.results.watch(task_id)  # before sending: no result can come unseen
        ended = False
        try:
            await self.send(task_id, kwargs)
            deadline = time.monotonic() + self.sync_timeout
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise GatewayError(504, f"no result after {self.sync_timeout:g} s (is any replica live?); the "
                                            "request was cancelled", code="timeout")
                done, _ = await asyncio.wait({future}, timeout=min(remaining, DISCONNECT_POLL_S))
                if done:
                    ended = True
                    return future.result()
                if await request.is_disconnected():
                    raise GatewayError(499, "client closed the connection; the request was cancelled",
                                       code="client_closed")
        finally:
            self.results.unwatch(task_id)
            if not ended:
                # Even if the send failed or was cut short: cancelling a request never sent does no harm.
                self.cancels.submit(cancel_request, task_id)

    async def job_records(self, ids: list[str]) -> list[tuple[str, dict, dict | None]]:
        """(id, record, result meta) of each job that still has a record."""
        if not ids:
            return []
        backend = celery_app.backend
        records = await self.redis.mget([JOB_KEY + i for i in ids])
        metas = await self.redis.mget([backend.get_key_for_task(i) for i in ids])
        return [(i, json.loads(rec), backend.decode_result(meta) if meta else None)
                for i, rec, meta in zip(ids, records, metas) if rec]

    async def job(self, video_id: str) -> tuple[dict, dict | None]:
        found = await self.job_records([video_id])
        if not found:
            raise GatewayError(404, f"video_id={video_id!r}: no such video job (unknown, deleted, or older than "
                                    f"REPLICADP_RESULT_TTL={SETTINGS.result_ttl_s} s)", code="not_found",
                               param="video_id")
        return found[0][1:]


def create_app(*, max_queue: int = 64, sync_timeout: float = 1800.0) -> FastAPI:
    """The gateway's ASGI app. `max_queue`: requests waiting in the shared queue past which new ones get 429;
    `sync_timeout`: seconds a sync request waits for its video before a 504 (and the request is cancelled)."""
    gw = Gateway(max_queue, sync_timeout)

    @asynccontextmanager
    async def lifespan(_):
        watcher = asyncio.create_task(gw.results.run())
        yield
        watcher.cancel()
        await gw.redis.aclose()

    api = FastAPI(title="replicadp HTTP gateway", version="1", lifespan=lifespan,
                  description="vllm-omni's video API in front of replicadp's replicas; see docs/http.md.")
    api.add_middleware(BodyCheck, limit=SETTINGS.max_image_bytes + FORM_ALLOWANCE)

    @api.exception_handler(HTTPException)
    async def http_error(_, exc: HTTPException):
        code = getattr(exc, "code", "not_found" if exc.status_code == 404 else "http_error")
        return JSONResponse(error_body(exc.status_code, str(exc.detail), code, getattr(exc, "param", None)),
                            status_code=exc.status_code, headers=exc.headers)

    @api.exception_handler(RequestValidationError)
    async def form_error(_, exc: RequestValidationError):
        """422 naming the first form field of the wrong type (or missing)."""
        first = exc.errors()[0]
        field = str(first["loc"][-1]) if first.get("loc") else None
        return JSONResponse(error_body(422, f"{field}: {first['msg']}", "invalid_type", field), status_code=422)

    @api.exception_handler(StoreError)
    async def store_error(_, exc: StoreError):
        """The result names a video the gateway cannot read (OUTPUT_DIR not shared with it, an expired key)."""
        return JSONResponse(error_body(502, str(exc), "store_unavailable", None), status_code=502)

    @api.exception_handler(RedisError)
    @api.exception_handler(OperationalError)
    async def redis_down(_, exc: Exception):
        message = f"cannot reach Redis: {exc}"
        return JSONResponse(error_body(503, message, "redis_unavailable", None), status_code=503)

    async def forget(video_id: str) -> None:
        async with gw.redis.pipeline() as pipe:
            pipe.delete(JOB_KEY + video_id)
            pipe.zrem(JOBS_KEY, video_id)
            await pipe.execute()

    @api.post("/v1/videos/sync", response_class=Response, responses={
        200: {"content": {"video/mp4": {}}, "description": "The MP4, with X-Request-Id, X-Model, X-Replica and "
                                                          "X-Inference-Time-S headers."}, **ERRORS})
    async def create_video_sync(request: Request, form: Annotated[VideoForm, Depends(video_form)]):
        """Generate one video and answer with its MP4 bytes."""
        task_id, kwargs, _ = await gw.admit(form)
        meta = await gw.run_sync(task_id, kwargs, request)
        if meta["status"] != states.SUCCESS:
            raise failure(meta)
        video = await asyncio.to_thread(fetch_video, meta["result"])
        return video_response(meta["result"], video)

    @api.post("/v1/videos", response_model=VideoJob, responses=ERRORS)
    async def create_video(form: Annotated[VideoForm, Depends(video_form)]):
        """Queue one video; answers at once with the job (poll GET /v1/videos/{id})."""
        task_id, kwargs, record = await gw.admit(form)
        now = time.time()
        record = {"id": task_id, "created_at": int(now), **record}
        async with gw.redis.pipeline() as pipe:  # the record first: a GET right after the POST finds it
            pipe.set(JOB_KEY + task_id, json.dumps(record), ex=SETTINGS.result_ttl_s)
            pipe.zadd(JOBS_KEY, {task_id: now})
            pipe.zremrangebyscore(JOBS_KEY, 0, now - SETTINGS.result_ttl_s)
            await pipe.execute()
        try:
            await gw.send(task_id, kwargs)
        except OperationalError:  # the broker is down: no job was made (503), so none must be listed
            await forget(task_id)
            raise
        return job_view(record, None)

    @api.get("/v1/videos", response_model=VideoList, responses=ERRORS)
    async def list_videos(limit: Annotated[int, Query(ge=1, le=100)] = 20, after: str | None = None,
                          order: Literal["asc", "desc"] = "desc"):
        """Jobs created through any gateway of this Redis, newest first (order=asc: oldest first)."""
        start = 0
        if after is not None:
            rank = await (gw.redis.zrevrank if order == "desc" else gw.redis.zrank)(JOBS_KEY, after)
            if rank is None:
                raise GatewayError(400, f"after={after!r}: no such video job", code="invalid_request", param="after")
            start = rank + 1
        read = gw.redis.zrevrange if order == "desc" else gw.redis.zrange
        ids = [i.decode() for i in await read(JOBS_KEY, start, start + limit)]
        jobs = [job_view(rec, meta) for _, rec, meta in await gw.job_records(ids[:limit])]
        return VideoList(data=jobs, first_id=jobs[0].id if jobs else None, last_id=jobs[-1].id if jobs else None,
                         has_more=len(ids) > limit)

    @api.get("/v1/videos/{video_id}", response_model=VideoJob, responses=ERRORS)
    async def get_video(video_id: str):
        """One job: status, progress (0-100, from the denoising step), error."""
        return job_view(*await gw.job(video_id))

    @api.get("/v1/videos/{video_id}/content", response_class=Response, responses={
        200: {"content": {"video/mp4": {}}, "description": "The MP4 of a completed job."}, **ERRORS})
    async def get_video_content(video_id: str):
        """The MP4 of a completed job, the same bytes a sync request for the same input answers."""
        record, meta = await gw.job(video_id)
        job = job_view(record, meta)
        if job.status != "completed":
            raise GatewayError(409, f"video_id={video_id!r}: the job is {job.status}, not completed",
                               code="not_completed", param="video_id")
        return video_response(meta["result"], await asyncio.to_thread(fetch_video, meta["result"]))

    @api.delete("/v1/videos/{video_id}", response_model=VideoDeleted, responses=ERRORS)
    async def delete_video(video_id: str):
        """Cancel the job if it is queued (it never runs) or running (it stops at its next denoising step), and
        forget it. A completed job's video stays in the output store."""
        record, meta = await gw.job(video_id)
        if job_view(record, meta).status in ("queued", "in_progress"):
            await asyncio.to_thread(cancel_request, video_id)
        await forget(video_id)
        return VideoDeleted(id=video_id, deleted=True)

    @api.get("/v1/models", response_model=ModelList)
    async def list_models():
        """The served model (what the live replicas load; REPLICADP_MODEL while none is live)."""
        live = await gw.replicas()
        loaded = {r.get("model"): int(r.get("loaded_at", 0)) for r in live}
        return ModelList(data=[ModelCard(id=m, created=loaded.get(m, 0)) for m in await gw.served_models()])

    @api.get("/health", response_model=Health, responses={503: {"model": Health}})
    async def health():
        """200 while at least one replica is live, else 503."""
        names = [r["name"] for r in await gw.replicas()]
        body = Health(status="ok" if names else "unavailable", replicas=names,
                      queue_depth=await gw.redis.llen(SETTINGS.queue))
        return JSONResponse(body.model_dump(), status_code=200 if names else 503)

    return api
