"""API keys: with keys configured, every `/v1/` route wants `Authorization: Bearer <key>`, as `vllm serve
--api-key` does; `/health`, the OpenAPI schema and the web page's files (`/ui`: it asks for the key and sends it
to /v1) stay open. Each key belongs to a tenant (its `name`, or a tenant of its own), which owns the jobs made
with it, its fairness lane and its webhook secret; a key may ask for priorities up to its `max_priority`.

A video's MP4 and poster may also be read through a signed link (`GET /v1/videos/{id}/links`): the path with
`expires` and `signature` (an HMAC of both under the key that asked), which a `<video>` element can use where it
cannot send a header. A link is good for that one file until it expires, and no longer than its key is configured.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs, quote

from replicadp_tasks.contract import TENANT_RE, Priority

from .errors import ErrorCode, error_response

PROTECTED = "/v1"  # the API; /health (load balancers, compose healthchecks), /docs and /ui stay open
SIGNED = re.compile(r"/v1/videos/[^/]+/(content|poster)")  # the files a signed link may read
LINK_S = 3600  # a signed link's life: a page open for an hour still plays and seeks its video
# A link's expiry is rounded up to this, so one page's links are the same URL for its span and the browser's
# cache, keyed by URL, serves a file again: a link lives LINK_S to LINK_S + LINK_STEP_S.
LINK_STEP_S = 600


class ApiKeyError(ValueError):
    """Raised when a configured API key cannot be used: empty, with a control character, or with an attribute
    that is not `name=` or `max_priority=` (or a bad value for one)."""


@dataclass(frozen=True)
class KeyPolicy:
    """What one API key may do. `owner`: the tenant id its jobs, fairness lane and webhook secret are bound to
    (its `name`, which several keys may share, as when a key is rotated; else a digest of the key); `max_priority`:
    the highest priority its requests may ask for."""

    key: str = field(repr=False)
    owner: str
    max_priority: Priority = Priority.NORMAL

    def allows(self, priority: Priority) -> bool:
        return list(Priority).index(priority) >= list(Priority).index(self.max_priority)


def _policy(key: str, attributes: list[str], where: str) -> KeyPolicy:
    if not key or any(not c.isprintable() for c in key):
        raise ApiKeyError(f"{where}: an API key must be printable characters without spaces")
    fields = {}
    for attribute in attributes:
        name, sep, value = attribute.partition("=")
        if not sep or name not in ("name", "max_priority") or name in fields:
            raise ApiKeyError(f"{where}: after the key come `name=TENANT` and `max_priority=PRIORITY`, each once "
                              f"(found an attribute {name[:32]!r})")
        fields[name] = value
    owner = fields.get("name", owner_of(key))
    if not TENANT_RE.fullmatch(owner):  # a fairness lane, a webhook secret's input, a job list's key
        raise ApiKeyError(f"{where}: name={owner[:80]!r}: 1-64 letters, digits, '_', '.', '-', starting with a letter "
                          "or digit")
    try:
        most = Priority(fields.get("max_priority", Priority.NORMAL))
    except ValueError:
        raise ApiKeyError(f"{where}: max_priority={fields['max_priority'][:32]!r}: one of "
                          f"{', '.join(Priority)}") from None
    return KeyPolicy(key, owner, most)


def read_keys(keys: tuple[str, ...], files: tuple[Path, ...]) -> list[KeyPolicy]:
    """The keys given on the command line (or REPLICADP_API_KEYS) and in files, each with its policy. A file has
    one key per line, optionally followed by `name=TENANT` and `max_priority=PRIORITY` (blank lines and `#`
    comments skipped); a key given on the command line has the defaults (its own tenant, `normal`). Raises
    ApiKeyError naming where a bad key came from (never the key), or a file that holds no key."""
    found = [_policy(key, [], f"--api-key #{i + 1}") for i, key in enumerate(keys)]
    for path in files:
        before = len(found)
        for n, line in enumerate(Path(path).read_text().splitlines(), 1):
            if line.strip() and not line.lstrip().startswith("#"):
                key, *attributes = line.split()
                found.append(_policy(key, attributes, f"{path}:{n}"))
        if len(found) == before:  # a file named to set keys: left empty (a copied example), the API would be open
            raise ApiKeyError(f"{path} holds no key (one per line; without any key the API would be open)")
    policies = {}
    for policy in found:
        if policies.setdefault(policy.key, policy) != policy:
            raise ApiKeyError(f"a key is given twice with different policies ({policies[policy.key].owner}, "
                              f"{policy.owner})")
    return list(policies.values())


def signature(key: str, path: str, expires: int) -> str:
    """The HMAC-SHA256 of a link to `path` until `expires` (unix seconds) under `key`, in hex."""
    message = f"replicadp-link\n{path}\n{expires}".encode()
    return hmac.new(key.encode(), message, hashlib.sha256).hexdigest()


def signed_link(policy: KeyPolicy, path: str, now: float | None = None) -> tuple[str, int]:
    """A link to `path` (a video's /content or /poster, unquoted) that reads it without a header, and when it
    expires."""
    expires = math.ceil(((now or time.time()) + LINK_S) / LINK_STEP_S) * LINK_STEP_S
    return f"{quote(path)}?expires={expires}&signature={signature(policy.key, path, expires)}", expires


def owner_of(key: str) -> str:
    """The tenant id of a key without a name: a digest, so that Redis never holds a key."""
    return hashlib.sha256(b"replicadp-api-key:" + key.encode()).hexdigest()[:24]


class ApiKeys:
    """ASGI middleware: answer 401 (OpenAI's error object, `WWW-Authenticate: Bearer`) to a `/v1` request without
    a configured key or a good signed link; let the others through with `request.state.policy` set to their key's
    KeyPolicy. Compared in constant time: the presented token is hashed, and its digest compared with every key's;
    a link's signature is compared with the one every key makes."""

    def __init__(self, app, keys: list[KeyPolicy]):
        self.app = app
        self.keys = [(hashlib.sha256(policy.key.encode()).digest(), policy) for policy in keys]

    def policy(self, token: bytes) -> KeyPolicy | None:
        digest, found = hashlib.sha256(token).digest(), None
        for key_digest, policy in self.keys:  # no early exit: the time does not say which key matched
            if hmac.compare_digest(digest, key_digest):
                found = policy
        return found

    def signer(self, scope) -> tuple[KeyPolicy | None, str]:
        """The policy whose key signed the link a GET of a video's file came with, or None and why not."""
        query = parse_qs(scope["query_string"].decode("latin-1"))
        expires, given = query.get("expires", [""])[0], query.get("signature", [""])[0]
        if not expires.isdigit():
            return None, f"expires={expires[:32]!r}: a signed link's expiry, unix seconds"
        found = None
        for _, policy in self.keys:  # no early exit, as for a key
            if hmac.compare_digest(given.encode(), signature(policy.key, scope["path"], int(expires)).encode()):
                found = policy
        if found is None:
            return None, "signature: not a link this gateway's keys signed (or its key was removed)"
        if int(expires) < time.time():
            return None, f"expires={expires}: the link has expired; GET /v1/videos/{{id}}/links makes a new one"
        return found, ""

    def caller(self, scope) -> tuple[KeyPolicy | None, str]:
        """The policy of the key a /v1 request came with (its header, or a signed link), or None and why not."""
        scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
        if scheme:
            policy = self.policy(token.strip()) if scheme.lower() == b"bearer" and token.strip() else None
            return policy, "Authorization: invalid API key"
        if scope["method"] == "GET" and SIGNED.fullmatch(scope["path"]) and b"signature=" in scope["query_string"]:
            return self.signer(scope)
        return None, "Authorization: missing; send the header `Authorization: Bearer <API key>`"

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] != "http" or not (path == PROTECTED or path.startswith(PROTECTED + "/")):
            return await self.app(scope, receive, send)
        policy, message = self.caller(scope)
        if policy is None:
            return await error_response(401, message, ErrorCode.INVALID_API_KEY,
                                        headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
        scope.setdefault("state", {})["policy"] = policy
        await self.app(scope, receive, send)
