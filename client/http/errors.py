"""The gateway's errors, each answered as OpenAI's error object (schema.ErrorBody)."""

from __future__ import annotations

from enum import StrEnum

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from replicadp_tasks.contract import InvalidRequest

# generate's argument -> the form field it comes from
HTTP_NAMES = {"image": "input_reference", "webhook": "webhook_url"}


class ErrorCode(StrEnum):
    """The `code` of an error answer, and of a failed job's `error`."""

    INVALID_REQUEST = "invalid_request"
    INVALID_TYPE = "invalid_type"  # a form field of the wrong type, or missing (422)
    MODEL_NOT_FOUND = "model_not_found"
    TOO_LARGE = "too_large"
    NOT_FOUND = "not_found"
    INVALID_HOST = "invalid_host"  # 400: a Host header not in the allow-list (a DNS-rebound name)
    FOREIGN_ORIGIN = "foreign_origin"  # 403: a keyless gateway's POST or DELETE sent from another site
    INVALID_API_KEY = "invalid_api_key"  # 401: no key, or one that is not configured (OpenAI's code)
    PRIORITY_NOT_ALLOWED = "priority_not_allowed"  # 403: a priority above the key's max_priority
    NOT_COMPLETED = "not_completed"
    QUEUE_FULL = "queue_full"
    TIMEOUT = "timeout"
    CLIENT_CLOSED = "client_closed"
    CANCELLED = "cancelled"
    GENERATION_FAILED = "generation_failed"
    STORE_UNAVAILABLE = "store_unavailable"
    REDIS_UNAVAILABLE = "redis_unavailable"
    SHUTTING_DOWN = "shutting_down"  # 503: a sync request handed over as a job when the gateway stopped
    HTTP_ERROR = "http_error"  # Starlette's own (405 and the like)
    INTERNAL_ERROR = "internal_error"  # 500: a fault in the gateway itself


class GatewayError(HTTPException):
    """Raised when a request cannot be answered as asked: answered as OpenAI's error object. An HTTPException,
    so that one raised while FastAPI reads the body (the body limit) keeps its status."""

    def __init__(self, status: int, message: str, *, code: ErrorCode, param: str | None = None, headers=None):
        super().__init__(status, message, headers)
        self.code, self.param = code, param


def error_response(status: int, message: str, code: str, param: str | None = None, headers=None) -> JSONResponse:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def invalid(exc: InvalidRequest) -> GatewayError:
    """400 naming the form field that generate's validation (here or in the task) refused."""
    param, message = HTTP_NAMES.get(exc.field, exc.field), str(exc)
    if message.startswith(exc.field):  # the message names generate's argument: name the form's field instead
        message = param + message[len(exc.field):]
    return GatewayError(400, message, code=ErrorCode.INVALID_REQUEST, param=param)


# Failure classes -> (HTTP status of a sync request, job error code); any other is a 502 "generation_failed"
# (the gateway worked, its upstream did not), so that a 500 always means a fault in the gateway itself. By name:
# Celery rebuilds an exception class it cannot import as a look-alike of the same name.
FAILURES = {"RequestCancelled": (409, ErrorCode.CANCELLED), "TaskRevokedError": (409, ErrorCode.CANCELLED),
            "SoftTimeLimitExceeded": (504, ErrorCode.TIMEOUT), "TimeLimitExceeded": (504, ErrorCode.TIMEOUT)}


def failure(meta: dict) -> GatewayError:
    """What a failed task (its result meta) means to an HTTP client: its status for a sync request, its code
    for a job."""
    exc = meta["result"]
    if isinstance(exc, InvalidRequest):
        return invalid(exc)
    status, code = FAILURES.get(type(exc).__name__, (502, ErrorCode.GENERATION_FAILED))
    return GatewayError(status, f"{type(exc).__name__}: {exc}", code=code)
