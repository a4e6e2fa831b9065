"""`replicadp submit FILE`: a batch of requests from JSONL or plain text, resumable by request_id."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from replicadp_tasks.errors import InvalidRequest
from replicadp_tasks.validate import DEFAULTS, validate_request


class BatchFileError(Exception):
    """Raised when lines of a batch file are malformed; lists every bad line with its number."""


def request_id_for(kwargs: dict) -> str:
    """A stable id for a line without one: re-running the file finds the same ids."""
    canonical = json.dumps(kwargs, sort_keys=True, separators=(",", ":"))
    return "req-" + hashlib.sha256(canonical.encode()).hexdigest()[:24]


def read_batch(path: Path) -> list[tuple[int, dict]]:
    """(line number, generate kwargs with a request_id) per request. JSONL when the first non-empty line
    starts with '{', else one prompt per line. Every malformed line is reported before anything is sent."""
    lines = [(n, line.strip()) for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    jsonl = bool(lines) and lines[0][1].startswith("{")
    requests, errors = [], []
    for n, line in lines:
        if jsonl:
            try:
                kwargs = json.loads(line)
            except ValueError as exc:
                errors.append(f"line {n}: not JSON ({exc.msg} at column {exc.colno})")
                continue
            if not isinstance(kwargs, dict):
                errors.append(f"line {n}: expected a JSON object of generate arguments, got {type(kwargs).__name__}")
                continue
        else:
            kwargs = {"prompt": line}
        try:
            # Model-independent checks here; the replica also checks what its model needs (size multiples).
            validate_request(kwargs, size_multiple=16)
        except InvalidRequest as exc:
            errors.append(f"line {n}: {exc}")
            continue
        kwargs.setdefault("request_id", request_id_for(kwargs))
        requests.append((n, kwargs))
    if errors:
        raise BatchFileError(f"{path}: {len(errors)} malformed line(s):\n" + "\n".join(errors))
    seen: dict[str, int] = {}
    for n, kwargs in requests:
        if kwargs["request_id"] in seen:
            raise BatchFileError(f"{path}: line {n}: request_id {kwargs['request_id']!r} repeats line {seen[kwargs['request_id']]}")
        seen[kwargs["request_id"]] = n
    return requests


def work(kwargs: dict) -> int:
    """A request's relative cost: pixels x frames x steps (the reference workload's defaults where unset)."""
    d = DEFAULTS
    return (kwargs.get("height") or d["height"]) * (kwargs.get("width") or d["width"]) * \
        (kwargs.get("num_frames") or d["num_frames"]) * (kwargs.get("num_inference_steps") or d["num_inference_steps"])


def longest_first(requests: list[dict]) -> list[dict]:
    """Largest requests first (stable): with every request known up front, the short ones fill the gaps at
    the end instead of one long request running alone."""
    return sorted(requests, key=work, reverse=True)


def completed_ids(results_path: Path) -> set[str]:
    """request_ids that already succeeded according to an earlier run's results file."""
    done = set()
    if results_path.exists():
        for line in results_path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a line cut short by an interrupted run
            if rec.get("ok"):
                done.add(rec["request_id"])
    return done
