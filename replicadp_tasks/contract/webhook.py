"""A request's webhook as producers, replicas and receivers agree on it: the `webhook` and `webhook_events` fields,
the events, the JSON body of each POST and its signature. What a deployment allows and how events are queued and
sent is the webhooks room's (replicadp_tasks/webhooks/); docs/http.md, "Webhooks", is the receiver's side."""

from __future__ import annotations

import hashlib
import hmac
import urllib.parse
from dataclasses import dataclass
from enum import StrEnum
from typing import NotRequired, TypedDict

from .errors import InvalidRequest
from .records import Result
from .scheduling import check_tenant


class Event(StrEnum):
    STARTED = "started"  # the delivery holds the request's fence and starts computing
    PROGRESS = "progress"  # a denoising step, as often as Progress is reported (replica.delivery.PROGRESS_EVERY_S)
    COMPLETED = "completed"  # the video is stored (or was: a request_id's stored result)
    FAILED = "failed"  # the request failed for good (a requeued request has not)
    PREEMPTED = "preempted"  # stopped at a step for a request of a higher priority, queued again to go on from there


EVENTS = frozenset(e.value for e in Event)
DEFAULT_EVENTS = frozenset({Event.COMPLETED, Event.FAILED})
MAX_URL_CHARS = 2048  # what web servers and proxies commonly accept; room for a token in the query
TENANT_SECRET_CONTEXT = "replicadp-webhook-tenant:"  # keys tenant_secret's HMAC to this one use of the secret

SIGNATURE_HEADER = "X-Replicadp-Signature"  # t=<unix seconds>,v1=<hex HMAC-SHA256 of "<t>.<body>">
EVENT_ID_HEADER = "X-Replicadp-Event-Id"  # the payload's id: the same on every attempt, for de-duplication
EVENT_HEADER = "X-Replicadp-Event"


@dataclass(frozen=True)
class Webhook:
    """Where a request's events go, and which ones."""

    url: str
    events: frozenset[Event]
    tenant: str | None = None  # the API key's owner that sent the request: whose secret signs its events


class Failure(TypedDict):
    type: str  # the exception's class: InvalidRequest, RequestCancelled, PoisonRequest, SoftTimeLimitExceeded, ...
    message: str


class Payload(TypedDict):
    """The JSON body of a webhook POST."""

    id: str  # the event id: <task id>.<event>, and .<step> for progress
    event: Event
    request_id: str  # the caller's request_id, else the task id
    task_id: str  # Celery's task id: the HTTP gateway's job id
    time: float  # when it happened (unix seconds)
    replica: str | None
    step: NotRequired[int]  # progress
    total_steps: NotRequired[int]  # progress
    result: NotRequired[Result]  # completed: the request's metadata, as generate returns it
    error: NotRequired[Failure]  # failed


def check_webhook(url, events, tenant=None) -> Webhook | None:
    """The webhook a request names (None: none): `url` (the `webhook` field) an http(s) URL of at most
    MAX_URL_CHARS, `events` (`webhook_events`) a list of Event values, or None for DEFAULT_EVENTS, signed for
    `tenant` (the `tenant` field: None, or an API key's owner id, scheduling.check_tenant). Its form only: what a
    deployment allows (webhooks on, a secret, the host's addresses) is webhooks.check_allowed's. Raises
    InvalidRequest naming the field and the value."""
    if url is None:
        if events is not None:
            raise InvalidRequest.of("webhook_events", "given without a webhook", value=events)
        return None
    if not isinstance(url, str):
        raise InvalidRequest.of("webhook", f"must be a string (an http(s) URL), got {type(url).__name__}", value=url)
    if len(url) > MAX_URL_CHARS:
        raise InvalidRequest.of("webhook", f"is {len(url)} characters long; the limit is {MAX_URL_CHARS}",
                                value=url)
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise InvalidRequest.of("webhook", "scheme not allowed; only http and https", value=url)
    if not url.isascii() or any(c.isspace() or not c.isprintable() for c in url):
        raise InvalidRequest.of("webhook", "must be ASCII without spaces or control characters (percent-encode "
                                           "the path, punycode the host)", value=url)
    try:
        valid = bool(parts.hostname) and parts.port != 0
    except ValueError:  # a port that is not a number, or out of range
        valid = False
    if not valid:
        raise InvalidRequest.of("webhook", "not a valid URL", value=url)
    if parts.username is not None:
        raise InvalidRequest.of("webhook", "credentials in the URL are not sent; the receiver verifies the "
                                           f"{SIGNATURE_HEADER} header instead", value=url)
    if events is None:
        chosen = DEFAULT_EVENTS
    elif isinstance(events, (list, tuple)) and events and all(isinstance(e, str) and e in EVENTS for e in events):
        chosen = frozenset(Event(e) for e in events)
    else:
        raise InvalidRequest.of("webhook_events", f"must be a non-empty list of {', '.join(Event)}", value=events)
    return Webhook(url, chosen, check_tenant(tenant))


def tenant_secret(deployment_secret: str, tenant: str) -> str:
    """The secret that signs `tenant`'s events: hex HMAC-SHA256, keyed by the deployment's secret, of
    TENANT_SECRET_CONTEXT + tenant. One tenant's secret tells nothing of another's, nor of the deployment's."""
    check_tenant(tenant)
    return hmac.new(deployment_secret.encode(), (TENANT_SECRET_CONTEXT + tenant).encode(), hashlib.sha256).hexdigest()


def signature(secret: str, timestamp: int, body: bytes) -> str:
    """The v1 signature: hex HMAC-SHA256, keyed by the secret, of `<timestamp>.<body>`."""
    return hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
