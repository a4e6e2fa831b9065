"""API keys: with keys configured, every `/v1/` route wants `Authorization: Bearer <key>`, as `vllm serve
--api-key` does; `/health`, the OpenAPI schema and the web page's files (`/ui`: it asks for the key and sends it
to /v1) stay open. Each key owns the jobs made with it.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from .errors import ErrorCode, error_response

PROTECTED = "/v1"  # the API; /health (load balancers, compose healthchecks), /docs and /ui stay open


class ApiKeyError(ValueError):
    """Raised when a configured API key cannot be used: empty, or with whitespace (a bearer token has none)."""


def read_keys(keys: tuple[str, ...], files: tuple[Path, ...]) -> list[str]:
    """The keys given on the command line (or REPLICADP_API_KEYS) and in files: one key per line, blank lines and
    `#` comments skipped. Raises ApiKeyError naming where a bad key came from (never the key)."""
    found = [(key, f"--api-key #{i + 1}") for i, key in enumerate(keys)]
    for path in files:
        for n, line in enumerate(Path(path).read_text().splitlines(), 1):
            if line.strip() and not line.lstrip().startswith("#"):
                found.append((line.strip(), f"{path}:{n}"))
    for key, where in found:
        if not key or any(c.isspace() or not c.isprintable() for c in key):
            raise ApiKeyError(f"{where}: an API key must be printable characters without spaces")
    return list(dict.fromkeys(key for key, _ in found))


def owner_of(key: str) -> str:
    """The id that job records keep for the key that made them: a digest, so that Redis never holds a key."""
    return hashlib.sha256(b"replicadp-api-key:" + key.encode()).hexdigest()[:24]


class ApiKeys:
    """ASGI middleware: answer 401 (OpenAI's error object, `WWW-Authenticate: Bearer`) to a `/v1` request without
    a configured key; let the others through with `request.state.owner` set to their key's owner id. Compared in
    constant time: the presented token is hashed, and its digest compared with every key's."""

    def __init__(self, app, keys: list[str]):
        self.app = app
        self.keys = [(hashlib.sha256(key.encode()).digest(), owner_of(key)) for key in keys]

    def owner(self, token: bytes) -> str | None:
        digest, found = hashlib.sha256(token).digest(), None
        for key_digest, owner in self.keys:  # no early exit: the time does not say which key matched
            if hmac.compare_digest(digest, key_digest):
                found = owner
        return found

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] != "http" or not (path == PROTECTED or path.startswith(PROTECTED + "/")):
            return await self.app(scope, receive, send)
        scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
        owner = self.owner(token.strip()) if scheme.lower() == b"bearer" and token.strip() else None
        if owner is None:
            message = ("Authorization: invalid API key" if scheme else
                       "Authorization: missing; send the header `Authorization: Bearer <API key>`")
            return await error_response(401, message, ErrorCode.INVALID_API_KEY,
                                        headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
        scope.setdefault("state", {})["owner"] = owner
        await self.app(scope, receive, send)
