"""The gateway's guard against being reached through a browser: the Host allow-list (a DNS-rebound name reads
nothing), the Origin check of a keyless gateway's state-changing routes (a cross-site form creates no job), and
the headers every answer carries."""

from __future__ import annotations

from urllib.parse import urlsplit

from .errors import ErrorCode, error_response

# The names of a gateway bound to loopback, at any port: the only ones a local browser rightly sends it.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
LOOPBACK_BINDS = ("127.0.0.1", "localhost", "::1")
ANY_HOST = "*"  # --allowed-hosts '*': answer every Host
EXEMPT = ("/health",)  # a load balancer's probe names the gateway by whatever address it has
STATE_CHANGING = ("POST", "PUT", "PATCH", "DELETE")
# On every answer: no content sniffing of a video or JSON as a page, no URL (a job id) leaked to other sites.
HEADERS = [(b"x-content-type-options", b"nosniff"), (b"referrer-policy", b"no-referrer")]


def default_hosts(bind: str) -> tuple[str, ...] | None:
    """The allow-list of a gateway bound to `bind` when none is given: loopback names on loopback, else any
    (None), since the names it is reached by are unknown."""
    return LOOPBACK_HOSTS if bind in LOOPBACK_BINDS else None


def allowed_hosts(given: tuple[str, ...], bind: str) -> tuple[str, ...] | None:
    """The Host names answered (lowercase, no port; None: any), from --allowed-hosts or its default."""
    if not given:
        return default_hosts(bind)
    if ANY_HOST in given:
        return None
    return tuple(host_name(h) for h in given)


def host_name(netloc: str) -> str:
    """`netloc`'s host, lowercase, without its port: '[::1]:8098' -> '[::1]', 'Example.com:80' -> 'example.com'."""
    netloc = netloc.strip().lower()
    if netloc.startswith("["):
        return netloc[:netloc.find("]") + 1] if "]" in netloc else netloc
    return netloc.rpartition(":")[0] if netloc.count(":") == 1 else netloc


class Guard:
    """ASGI middleware, outermost: 400 to a request whose Host is not allowed (`hosts`; None: any), except on
    EXEMPT paths; without API keys (`keyless`), 403 to a state-changing request whose Origin is neither the
    request's own Host nor an allowed host; HEADERS on every answer, errors included."""

    def __init__(self, app, hosts: tuple[str, ...] | None, keyless: bool):
        self.app, self.hosts, self.keyless = app, hosts, keyless

    def refusal(self, scope):
        headers = {k: v.decode("latin-1") for k, v in scope["headers"] if k in (b"host", b"origin")}
        host = headers.get(b"host", "")
        if self.hosts is not None and scope["path"] not in EXEMPT and host_name(host) not in self.hosts:
            return error_response(400, f"Host: {host!r} is not a name this gateway answers to (allowed: "
                                       f"{', '.join(self.hosts)}; --allowed-hosts, REPLICADP_ALLOWED_HOSTS)",
                                  ErrorCode.INVALID_HOST)
        origin = headers.get(b"origin")
        if self.keyless and origin is not None and scope["method"] in STATE_CHANGING:
            netloc = urlsplit(origin).netloc.lower()
            if netloc != host.lower() and (self.hosts is None or host_name(netloc) not in self.hosts):
                return error_response(403, f"Origin: {origin!r} is another site; without API keys a "
                                           f"{scope['method']} must come from this gateway's own pages or "
                                           "a client that sends no Origin", ErrorCode.FOREIGN_ORIGIN)
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def with_headers(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *HEADERS]
            await send(message)

        refused = self.refusal(scope)
        await (self.app if refused is None else refused)(scope, receive, with_headers)
