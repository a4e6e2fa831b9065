"""The gateway's ASGI app: the routes, the body check, and every error answered as OpenAI's error object."""

from __future__ import annotations

import asyncio
import logging
import resource
import sys
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from kombu.exceptions import OperationalError
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException
from uvicorn.main import STARTUP_FAILURE
from uvicorn.protocols.http.h11_impl import H11Protocol

from replicadp_tasks.contract import StoreError
from replicadp_tasks.settings import SETTINGS

from .auth import ApiKeys, KeyPolicy
from .body import FORM_ALLOWANCE, BodyCheck
from .errors import ErrorCode, error_response
from .gateway import Gateway
from .guard import HEADERS as GUARD_HEADERS
from .guard import LOOPBACK_HOSTS, Guard
from .routes import router
from .ui import router as ui_router

log = logging.getLogger("replicadp")
# uvicorn's own graceful wait outlasts the gateway's grace by this much, so that a sync request handed over at the
# end of the grace (a job record written, a 503 sent) is answered before uvicorn cancels what is left (a 500).
HANDOVER_SLACK_S = 5.0
# A connection that sends no complete request headers this long after it opened, or after its last answer, is
# closed: uvicorn closes an idle keep-alive connection after an answer, but never one that sends nothing, or its
# headers a byte at a time, which, a few hundred at once, spend the process's file descriptors (accept: EMFILE).
HEADER_TIMEOUT_S = 10.0
KEEP_ALIVE_S = 5  # uvicorn's own default: an idle keep-alive connection is closed after this long
# Connections past which uvicorn answers 503 at once (/health too), by default the open-file limit less these
# descriptors for everything else (the Redis pool, Celery's connections, threads, logs, video files being read).
RESERVED_FDS = 128
# Past the connection limit less this many, the longest-idle connections (no request in progress for SHED_IDLE_S)
# are closed until it is back under, as new ones come and every tick: connections that send nothing cannot fill the
# limit, nor the process's file descriptors, and a request on a new connection (/health) still finds room.
SHED_MARGIN = 4
# A client sends its request within milliseconds of connecting: one silent this long is shed under pressure, and a
# connection just accepted (a burst of them comes in one accept loop) is not closed before its request is read.
SHED_IDLE_S = 0.25
ACCEPT_ERRORS_EVERY_S = 10.0  # accept() failing (EMFILE...) is logged once per this long, with a count


@asynccontextmanager
async def lifespan(api: FastAPI):
    api.state.gateway.start()
    yield
    await api.state.gateway.close()


async def http_error(_, exc: HTTPException):
    """A GatewayError, or Starlette's own (an unknown route, a wrong method)."""
    default = ErrorCode.NOT_FOUND if exc.status_code == 404 else ErrorCode.HTTP_ERROR
    return error_response(exc.status_code, str(exc.detail), getattr(exc, "code", default),
                          getattr(exc, "param", None), exc.headers)


async def form_error(_, exc: RequestValidationError):
    """422 naming the first form field of the wrong type (or missing)."""
    first = exc.errors()[0]
    field = str(first["loc"][-1]) if first.get("loc") else None
    return error_response(422, f"{field}: {first['msg']}", ErrorCode.INVALID_TYPE, field)


async def store_error(_, exc: StoreError):
    """502: the result names a video the gateway cannot read (OUTPUT_DIR not shared with it, an expired key)."""
    return error_response(502, str(exc), ErrorCode.STORE_UNAVAILABLE)


async def redis_down(_, exc: Exception):
    """503: Redis is down, stalled or failing over. The answer names the kind of failure only: redis-py's message
    names the server's address, which is the deployment's, not the client's, business (the log has it)."""
    log.warning("answered 503: cannot reach Redis: %s", exc)
    return error_response(503, f"cannot reach Redis ({type(exc).__name__}); try again shortly",
                          ErrorCode.REDIS_UNAVAILABLE)


async def fault(_, exc: Exception):
    """500, for a fault in the gateway itself (no input should reach it): OpenAI's error object with the headers
    every answer carries, which Starlette's own 500 (answered outside the guard, plain text) lacks."""
    return error_response(500, f"internal error ({type(exc).__name__}); the gateway's log has it",
                          ErrorCode.INTERNAL_ERROR, headers={k.decode(): v.decode() for k, v in GUARD_HEADERS})


def create_app(*, max_queue: int = 64, sync_timeout: float = 1800.0, api_keys: list[KeyPolicy] = (),
               allowed_hosts: tuple[str, ...] | None = LOOPBACK_HOSTS, docs: bool = False) -> FastAPI:
    """The gateway's ASGI app. `max_queue`: requests waiting in a model's queue past which new ones for that model
    get 429; `sync_timeout`: seconds a sync request waits for its video before a 504 (and the request is cancelled);
    `api_keys`: the bearer tokens `/v1` wants, each with its policy (auth.read_keys; none: the API is open);
    `allowed_hosts`: the Host names it answers (guard.allowed_hosts; None: any); `docs`: serve FastAPI's /docs
    and /redoc pages (off: they load their scripts from a CDN, same-origin with /ui)."""
    api = FastAPI(title="replicadp HTTP gateway", version="1", lifespan=lifespan,
                  description="vllm-omni's video API in front of replicadp's replicas; see docs/http.md.",
                  docs_url="/docs" if docs else None, redoc_url="/redoc" if docs else None)
    # No redirect built from the Host header (/ui/ -> http://<Host>/ui): a wrong path is a 404 instead.
    api.router.redirect_slashes = False
    api.state.gateway = Gateway(max_queue, sync_timeout)
    api.add_middleware(BodyCheck, limit=SETTINGS.max_image_bytes + FORM_ALLOWANCE)
    if api_keys:  # added last, so outermost: a request without a key is refused before its body is read
        api.add_middleware(ApiKeys, keys=list(api_keys))
    # Outermost of all: a request to a name not allowed is refused before anything else reads it.
    api.add_middleware(Guard, hosts=allowed_hosts, keyless=not api_keys)
    api.add_exception_handler(HTTPException, http_error)
    api.add_exception_handler(RequestValidationError, form_error)
    api.add_exception_handler(StoreError, store_error)
    api.add_exception_handler(RedisError, redis_down)
    api.add_exception_handler(OperationalError, redis_down)  # kombu's: the broker (Redis) is unreachable
    api.add_exception_handler(Exception, fault)  # Starlette's outermost handler: it logs the traceback too
    api.include_router(router)
    api.include_router(ui_router)  # the web page, /ui (docs/ui.md)
    return api


class Server(uvicorn.Server):
    """uvicorn's server, which tells the gateway when a graceful shutdown (SIGTERM, Ctrl-C) begins: uvicorn waits
    for the requests in flight, and the gateway hands over the sync requests still waiting after its grace. Its
    event loop logs a failing accept() (out of file descriptors) once per ACCEPT_ERRORS_EVERY_S, not per attempt."""

    def __init__(self, config: uvicorn.Config, grace: float):
        super().__init__(config)
        self.grace = grace

    async def startup(self, sockets=None) -> None:
        asyncio.get_running_loop().set_exception_handler(AcceptErrors().handle)
        await super().startup(sockets)

    async def on_tick(self, counter: int) -> bool:
        shed(self.server_state.connections)  # also while accept() fails: no new connection would
        return await super().on_tick(counter)

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            self.config.app.state.gateway.stop(self.grace)
        super().handle_exit(sig, frame)


class Deadlined(H11Protocol):
    """uvicorn's h11 protocol with a header-read deadline (`header_timeout`, a class attribute set by `serve`):
    the connection is closed unless a request's headers have come `header_timeout` seconds after it opened or
    after its last answer. And under pressure, past `shed_above` open connections (set by `serve`), a new
    connection closes those idle longest (`shed`)."""

    header_timeout = HEADER_TIMEOUT_S
    shed_above: int | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.idle_since = self.loop.time()
        self._arm()
        shed(self.connections)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.idle_since = self.loop.time()
        self._arm()

    def idle_for(self, now: float) -> float:
        """Seconds since it opened or last answered, with no request in progress; 0 while one is."""
        busy = self.cycle is not None and not self.cycle.response_complete
        return 0.0 if busy else now - self.idle_since

    def _arm(self) -> None:
        waited_for = self.cycle  # a new request's headers make a new cycle
        self.loop.call_later(self.header_timeout, self._headers_late, waited_for)

    def _headers_late(self, waited_for) -> None:
        if self.cycle is waited_for and not self.transport.is_closing():
            self.transport.close()


def shed(connections: set) -> None:
    """Past Deadlined.shed_above open `connections`, close those idle SHED_IDLE_S or more, longest-idle first, until
    they are back under."""
    above = Deadlined.shed_above
    if above is None or len(connections) <= above:
        return
    now = asyncio.get_running_loop().time()
    live = [c for c in connections if not c.transport.is_closing()]  # those closing leave at their next turn
    idle = sorted((c for c in live if c.idle_for(now) >= SHED_IDLE_S), key=lambda c: c.idle_since)
    for conn in idle[:len(live) - above]:
        conn.transport.close()


class AcceptErrors:
    """An event loop's exception handler that folds the loop's `socket.accept() out of system resource` errors into
    one line per ACCEPT_ERRORS_EVERY_S (asyncio pauses accepting for a second after each) and drops the retry of a
    paused accept that finds the server closed; every other error goes to the loop's default handler."""

    def __init__(self):
        self.count, self.last = 0, float("-inf")

    def handle(self, loop, context: dict) -> None:
        if "_start_serving" in repr(context.get("handle")) and isinstance(context.get("exception"), ValueError):
            return  # asyncio's accept, paused by a failure, retried after the server closed its socket: at shutdown
        if not str(context.get("message", "")).startswith("socket.accept() out of system resource"):
            loop.default_exception_handler(context)
            return
        self.count += 1
        if loop.time() - self.last >= ACCEPT_ERRORS_EVERY_S:
            log.error("cannot accept connections: %s (%d time(s) in the last %.0f s; the longest-idle connections "
                      "are closed to make room)", context.get("exception"), self.count, ACCEPT_ERRORS_EVERY_S)
            self.count, self.last = 0, loop.time()


def default_max_connections() -> int:
    """The open-file limit (soft) less RESERVED_FDS, at least 1."""
    return max(1, resource.getrlimit(resource.RLIMIT_NOFILE)[0] - RESERVED_FDS)


def serve(api: FastAPI, *, host: str, port: int, grace: float, log_config: dict, max_connections: int | None = None,
          header_timeout: float = HEADER_TIMEOUT_S, keep_alive: int = KEEP_ALIVE_S) -> None:
    """Serve `api` (create_app's) until SIGTERM or Ctrl-C; then wait up to `grace` seconds for the sync requests
    in flight, and answer those still waiting 503 with their job id (Gateway.run_sync). Past `max_connections`
    open connections (default: default_max_connections()) a request gets uvicorn's 503 at once, and past
    SHED_MARGIN fewer a new connection closes the longest-idle ones; a connection closes `header_timeout` seconds
    after it opened or answered unless a request's headers came, and an idle keep-alive one after `keep_alive`
    seconds."""
    limit = max_connections or default_max_connections()
    Deadlined.header_timeout, Deadlined.shed_above = header_timeout, max(1, limit - SHED_MARGIN)
    config = uvicorn.Config(api, host=host, port=port, log_config=log_config, http=Deadlined,
                            limit_concurrency=limit,
                            timeout_keep_alive=keep_alive, timeout_graceful_shutdown=grace + HANDOVER_SLACK_S)
    server = Server(config, grace)
    try:
        server.run()
    except KeyboardInterrupt:  # the Ctrl-C that uvicorn raises again once it has shut down
        pass
    if not server.started:  # it could not bind (uvicorn.run's exit status)
        sys.exit(STARTUP_FAILURE)
