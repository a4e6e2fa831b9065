"""Queueing a request's webhook events: the pool child (and, for a failure, the main process) writes each event to
Redis, once per task, for the senders (sender.py) to POST; the replica never waits on a receiver."""

from __future__ import annotations

import json
import logging
import time
import urllib.parse
from typing import TypedDict

import redis

from ..cluster.scripts import lua
from ..contract.errors import InvalidRequest
from ..contract.keys import STATS_KEY, WEBHOOK_DUE_KEY, WEBHOOK_EVENTS_KEY, WEBHOOK_SENT_KEY
from ..contract.webhook import Event, Failure, Payload, Webhook, check_webhook
from ..settings import SETTINGS
from .policy import available, check_allowed

log = logging.getLogger("replicadp")

# Events queued for one request, ever: progress past MAX_EVENTS_PER_REQUEST - 3 is dropped (counted), so that
# started, completed and failed always have room.
MAX_EVENTS_PER_REQUEST = 64
MAX_ERROR_CHARS = 1000  # of a failure's message in its event
QUEUE = lua(__package__, "queue")


class Queued(TypedDict):
    """An event waiting in Redis (WEBHOOK_EVENTS_KEY) for a sender."""

    url: str
    dest: str  # host:port, the unit of isolation (PER_HOST_SENDS, host backoff)
    tenant: str | None  # signs with tenant_secret(...) when set, else with the deployment secret
    payload: Payload


def event_id(task_id: str, event: Event, step: int | None = None) -> str:
    return f"{task_id}.{event}" if step is None else f"{task_id}.{event}.{step}"


def emit(client: redis.Redis, webhook: Webhook | None, event: Event, *, task_id: str, request_id: str,
         replica: str | None, **fields) -> None:
    """Queue `event` (with its `fields`: Payload's) for `webhook`, if it asks for it and it was not queued for
    this task before. A Redis error is logged, never raised: telling the caller must not fail the request."""
    if webhook is None or event not in webhook.events:
        return
    eid = event_id(task_id, event, fields.get("step"))
    payload = Payload(id=eid, event=event, request_id=request_id, task_id=task_id, time=time.time(),
                      replica=replica, **fields)
    queued = Queued(url=webhook.url, dest=destination(webhook.url), tenant=webhook.tenant, payload=payload)
    try:
        client.eval(QUEUE, 4, WEBHOOK_SENT_KEY + task_id, WEBHOOK_DUE_KEY, WEBHOOK_EVENTS_KEY, STATS_KEY, eid,
                    json.dumps(queued, default=repr), SETTINGS.result_ttl_s, "1" if event == Event.PROGRESS else "",
                    MAX_EVENTS_PER_REQUEST - 3)
    except redis.RedisError as exc:
        log.warning("webhook: cannot queue event %s: %s", eid, exc)


def emit_failure(client: redis.Redis, kwargs: dict, task_id: str, replica: str | None, exc: BaseException) -> None:
    """Queue the `failed` event of a request that failed for good, if it names a webhook that passes the checks
    (a request may fail before its validation: cancelled or poison)."""
    if not available():
        return
    try:
        webhook = check_webhook(kwargs.get("webhook"), kwargs.get("webhook_events"), kwargs.get("tenant"))
        check_allowed(webhook)
    except InvalidRequest:  # the webhook itself (or its tenant) was what failed it, or may not be reached
        return
    request_id = kwargs.get("request_id")
    emit(client, webhook, Event.FAILED, task_id=task_id,
         request_id=request_id if isinstance(request_id, str) else task_id, replica=replica,
         error=Failure(type=type(exc).__name__, message=str(exc)[:MAX_ERROR_CHARS]))


def destination(url: str) -> str:
    """The host:port that `url` reaches (lower case; the scheme's port if none): the unit of isolation."""
    parts = urllib.parse.urlsplit(url)
    return f"{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"
