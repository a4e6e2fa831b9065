"""What a replica accepts from its queue: a `replicadp.generate` request in Celery's message protocol 2, inside
kombu's Redis envelope, and nothing else.

Anything that can write to Redis can push bytes onto the queue, and Celery's main process reads a message's
envelope, headers and body before any task code runs: a body that is a JSON string, a `timelimit` of "abc", an
envelope that is not JSON or a null delivery tag each crashed it, and a message with no `id` made its consumer
reconnect forever. So every message is checked here, in full, before Celery sees it; the request's own fields
are contract/request.py's, checked by the task.
"""

from __future__ import annotations

import base64
import binascii
import json
from numbers import Real

from celery.utils.time import maybe_iso8601

from ..contract.errors import MessageRefused
from ..settings import SETTINGS

TASK_NAME = "replicadp.generate"
MAX_ID_CHARS = 255  # a task id is a uuid (36); room for the ids other producers choose, not for a payload
# A request is a few hundred bytes, or an inline first frame: base64 in the kwargs, base64 again in the envelope.
MAX_MESSAGE_BYTES = SETTINGS.max_image_bytes * 16 // 9 + 1024 * 1024

# The headers Celery 5's protocol 2 sends, those replicadp's producers stamp (the send time, priority, tenant and
# user: app.py; the fair tags: placement.py), and the flag kombu sets on a message it requeues (as it does the
# envelope's and delivery_info's).
HEADERS = {"lang", "task", "id", "shadow", "eta", "expires", "group", "group_index", "retries", "timelimit",
           "root_id", "parent_id", "argsrepr", "kwargsrepr", "origin", "ignore_result", "replaced_task_nesting",
           "stamped_headers", "stamps", "replicadp_sent_at", "replicadp_priority", "replicadp_tenant",
           "replicadp_user", "replicadp_order", "replicadp_user_order", "redelivered"}
PROPERTIES = {"correlation_id", "reply_to", "delivery_mode", "delivery_info", "priority", "body_encoding",
              "delivery_tag", "expiration"}
ENVELOPE = {"body", "content-encoding", "content-type", "headers", "properties", "redelivered"}
EMBED = {"callbacks", "errbacks", "chain", "chord"}


def task_id_of(envelope) -> str | None:
    """The id a client could be waiting on, if the message names a usable one."""
    headers = envelope.get("headers") if isinstance(envelope, dict) else None
    task_id = headers.get("id") if isinstance(headers, dict) else None
    return task_id if isinstance(task_id, str) and 0 < len(task_id) <= MAX_ID_CHARS else None


def check(raw: bytes) -> dict:
    """The envelope of `raw`, decoded, if it is a request a replica serves; else MessageRefused, with the reason
    and (when the message has one) the task id."""
    if len(raw) > MAX_MESSAGE_BYTES:
        raise MessageRefused(f"message of {len(raw)} bytes: more than {MAX_MESSAGE_BYTES}")
    try:
        envelope = json.loads(raw)
    except ValueError:  # also not UTF-8
        raise MessageRefused("envelope is not JSON") from None
    except RecursionError:  # nested past the decoder's recursion: no request is
        raise MessageRefused("envelope nests lists or objects too deep") from None
    if not isinstance(envelope, dict):
        raise MessageRefused(f"envelope is a JSON {type(envelope).__name__}, not an object")
    task_id = task_id_of(envelope)
    try:
        _check_envelope(envelope)
    except MessageRefused as exc:
        raise MessageRefused(str(exc), task_id=task_id) from None
    return envelope


def _check_envelope(envelope: dict) -> None:
    _only(envelope, ENVELOPE, "envelope")
    if envelope.get("content-type") != "application/json" or envelope.get("content-encoding") != "utf-8":
        raise MessageRefused(f"content-type={envelope.get('content-type')!r}, content-encoding="
                             f"{envelope.get('content-encoding')!r}: only application/json in utf-8 is served")
    _check_properties(_object(envelope, "properties", "envelope"))
    _check_headers(_object(envelope, "headers", "envelope"))
    if not isinstance(envelope.get("body"), str):
        raise MessageRefused("body: not a string")
    try:
        body = json.loads(base64.b64decode(envelope["body"], validate=True))
    except (binascii.Error, ValueError):
        raise MessageRefused("body: not base64 of JSON") from None
    except RecursionError:
        raise MessageRefused("body: nests lists or objects too deep") from None
    _check_body(body)


def _check_properties(props: dict) -> None:
    _only(props, PROPERTIES, "properties")
    _text(props, "delivery_tag", "properties", required=True)
    if props.get("body_encoding") != "base64":
        raise MessageRefused(f"properties.body_encoding={props.get('body_encoding')!r}: must be 'base64'")
    info = _object(props, "delivery_info", "properties")
    for key in ("exchange", "routing_key"):
        _text(info, key, "properties.delivery_info")
    for key in ("correlation_id", "reply_to", "expiration"):
        _text(props, key, "properties")
    for key in ("delivery_mode", "priority"):
        if key in props and not _int(props[key], 0, 255):
            raise MessageRefused(f"properties.{key}={props[key]!r}: not an integer from 0 to 255")


def _check_headers(headers: dict) -> None:
    _only(headers, HEADERS, "headers")
    if headers.get("task") != TASK_NAME:
        raise MessageRefused(f"headers.task={headers.get('task')!r}: replicas serve only {TASK_NAME!r}")
    _text(headers, "id", "headers", required=True)
    for key in ("lang", "shadow", "group", "root_id", "parent_id", "argsrepr", "kwargsrepr", "origin",
                "replicadp_priority", "replicadp_tenant", "replicadp_user"):
        _text(headers, key, "headers")
    if headers.get("eta") is not None:
        raise MessageRefused(f"headers.eta={headers['eta']!r}: replicas do not serve eta or countdown (a request "
                             "would sit reserved in a replica that could be running another)")
    if headers.get("expires") is not None:
        try:
            maybe_iso8601(headers["expires"])
        except (TypeError, ValueError):
            raise MessageRefused(f"headers.expires={headers['expires']!r}: not an ISO 8601 time") from None
    limits = headers.get("timelimit")
    if limits is not None:
        if not (isinstance(limits, list) and len(limits) == 2 and all(_limit(v) for v in limits)):
            raise MessageRefused(f"headers.timelimit={limits!r}: must be [hard, soft], each null or seconds from 1 "
                                 f"to the replica's REPLICADP_TIME_LIMIT ({SETTINGS.time_limit_s})")
    for key, most in (("retries", 1_000_000), ("group_index", 1_000_000), ("replaced_task_nesting", 1_000_000),
                      ("replicadp_order", 2**53), ("replicadp_user_order", 2**53)):
        if headers.get(key) is not None and not _int(headers[key], 0, most):
            raise MessageRefused(f"headers.{key}={headers[key]!r}: not a non-negative integer")
    for key in ("ignore_result", "redelivered"):
        if headers.get(key) is not None and not isinstance(headers[key], bool):
            raise MessageRefused(f"headers.{key}={headers[key]!r}: not a boolean")
    sent_at = headers.get("replicadp_sent_at")
    if sent_at is not None and (isinstance(sent_at, bool) or not isinstance(sent_at, Real)):
        raise MessageRefused(f"headers.replicadp_sent_at={sent_at!r}: not a time in seconds")
    stamped = headers.get("stamped_headers")
    if stamped is not None and not (isinstance(stamped, list) and all(isinstance(s, str) for s in stamped)):
        raise MessageRefused(f"headers.stamped_headers={stamped!r}: not a list of names")
    if "stamps" in headers and not isinstance(headers["stamps"], dict):
        raise MessageRefused(f"headers.stamps={headers['stamps']!r}: not an object")


def _check_body(body) -> None:
    if not (isinstance(body, list) and len(body) == 3):
        raise MessageRefused(f"body: {_kind(body)}, not [args, kwargs, embed]")
    args, kwargs, embed = body
    if not (isinstance(args, list) and len(args) <= 1 and all(isinstance(a, str) for a in args)):
        raise MessageRefused(f"body args: {_kind(args)}; generate takes at most one, the prompt, as a string")
    if not isinstance(kwargs, dict):
        raise MessageRefused(f"body kwargs: {_kind(kwargs)}, not an object")
    if not isinstance(embed, dict) or set(embed) - EMBED:
        raise MessageRefused(f"body embed: {_kind(embed)}, not an object of {sorted(EMBED)}")
    linked = sorted(k for k, v in embed.items() if v is not None)
    if linked:
        raise MessageRefused(f"body embed: {', '.join(linked)} set; replicas run no callbacks, chains or chords")


def _only(obj: dict, allowed: set, where: str) -> None:
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise MessageRefused(f"{where}: unknown field {unknown[0]!r}")


def _object(obj: dict, key: str, where: str) -> dict:
    value = obj.get(key)
    if not isinstance(value, dict):
        raise MessageRefused(f"{where}.{key}: {_kind(value)}, not an object")
    return value


def _text(obj: dict, key: str, where: str, required: bool = False) -> None:
    value = obj.get(key)
    if value is None and not required:
        return
    if not (isinstance(value, str) and (value or not required) and len(value) <= 64 * 1024):
        raise MessageRefused(f"{where}.{key}={str(value)[:80]!r}: not a{' non-empty' if required else ''} string")
    if required and len(value) > MAX_ID_CHARS:
        raise MessageRefused(f"{where}.{key}: more than {MAX_ID_CHARS} characters")


def _int(value, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _limit(value) -> bool:
    return value is None or (isinstance(value, Real) and not isinstance(value, bool)
                             and 1 <= value <= SETTINGS.time_limit_s)


def _kind(value) -> str:
    return "missing" if value is None else f"a JSON {type(value).__name__}"
