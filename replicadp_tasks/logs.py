"""Log lines: the libraries' own text, or one JSON object per line (REPLICADP_LOG_FORMAT=json) that a log shipper
takes as it is. Every JSON line says which process wrote it (role, replica, pid) and, if it is about a request or
was written while one ran, which (task_id, request_id).

Imports no Celery: worker.py hands Celery's handlers over once Celery has set them up; the gateway passes
`uvicorn_config` to uvicorn.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from enum import StrEnum


class LogFormat(StrEnum):
    TEXT = "text"  # Celery's and uvicorn's own formats
    JSON = "json"  # one JSON object per line


class Role(StrEnum):
    """Which kind of process wrote a line (worker_launch.sh's own lines say "launcher")."""

    REPLICA = "replica"
    GATEWAY = "gateway"


@dataclass(frozen=True)
class Running:
    task_id: str
    request_id: str  # the caller's, else the task id (as tasks.py names the request)


# The request this process runs. A global, not a contextvar: every thread of a pool child (the fence keeper's
# too) logs about the request the child computes (one at a time: concurrency 1), except the finisher's, which
# ends the one before it and names that one (`finishing`).
_running: Running | None = None
_finishing = threading.local()


def request_started(task_id: str, request_id: str) -> None:
    global _running
    _running = Running(task_id, request_id)


def request_ended() -> None:
    global _running
    _running = None


@contextmanager
def finishing(task_id: str, request_id: str):
    """The lines this thread logs meanwhile name this request, not the one the pool child computes."""
    _finishing.running = Running(task_id, request_id)
    try:
        yield
    finally:
        _finishing.running = None


# A gateway route about one job (a job id is its task id): /v1/videos/{id} and /v1/videos/{id}/content.
JOB_PATH = re.compile(r"/v1/videos/(?!sync(?:[/?]|$))([^/?]+)")


def _task_of(record: logging.LogRecord) -> str | None:
    """The task a line is about, when it is not written while a request runs: Celery's task lines in a replica's
    main process (received, lost, timed out) carry their context as `extra={"data": ...}` (celery.app.trace.info),
    uvicorn's access lines their path."""
    data = getattr(record, "data", None)
    if isinstance(data, dict) and isinstance(data.get("id"), str):
        return data["id"]
    if record.name == "uvicorn.access" and isinstance(record.args, tuple) and len(record.args) == 5:
        job = JOB_PATH.match(str(record.args[2]))
        return job[1] if job else None
    return None


class Context(logging.Filter):
    """On a handler: gives every line that reaches it the process's role and replica name, and the request it is
    about (`task_id`, `request_id`; `request_id` None outside a request). Lets every line through."""

    def __init__(self, role: Role, replica: str | None = None):
        super().__init__()
        self.role, self.replica = role, replica

    def filter(self, record: logging.LogRecord) -> bool:
        record.role, record.replica = self.role, self.replica
        running = getattr(_finishing, "running", None) or _running
        if running is not None:
            record.task_id, record.request_id = running.task_id, running.request_id
        else:
            record.request_id = None
            task_id = _task_of(record)
            if task_id is not None:
                record.task_id = task_id
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (ISO 8601, UTC), level, logger, message, role, replica, pid, task_id and
    request_id when known, an access line's client, method, path and status, and a traceback as `exc`."""

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "role": getattr(record, "role", None),
            "replica": getattr(record, "replica", None),
            "pid": record.process,
        }
        for field in ("task_id", "request_id"):
            value = getattr(record, field, None)
            if value is not None:
                line[field] = value
        if record.name == "uvicorn.access" and isinstance(record.args, tuple) and len(record.args) == 5:
            line.update(zip(("client", "method", "path", "http_version", "status"), record.args))
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, default=str)


def configure(handlers: list[logging.Handler], log_format: LogFormat, role: Role, replica: str | None = None) -> None:
    """Give `handlers` the request context and, in JSON, the JSON format."""
    context = Context(role, replica)
    for handler in handlers:
        handler.addFilter(context)
        if log_format == LogFormat.JSON:
            handler.setFormatter(JsonFormatter())


def uvicorn_config(log_format: LogFormat) -> dict:
    """The gateway's `log_config` for uvicorn: uvicorn's own in text; in JSON, one handler on stderr for every
    logger (uvicorn's, its access log, Celery's and ours)."""
    if log_format == LogFormat.TEXT:
        from uvicorn.config import LOGGING_CONFIG

        return LOGGING_CONFIG
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"context": {"()": Context, "role": Role.GATEWAY}},
        "formatters": {"json": {"()": JsonFormatter}},
        "handlers": {"json": {"class": "logging.StreamHandler", "stream": "ext://sys.stderr", "formatter": "json",
                              "filters": ["context"]}},
        # uvicorn's loggers without handlers of their own: their lines reach the root's, like everyone else's.
        "loggers": {name: {"handlers": [], "level": "INFO", "propagate": True}
                    for name in ("uvicorn", "uvicorn.error", "uvicorn.access")},
        "root": {"handlers": ["json"], "level": "INFO"},
    }
