"""`replicadp submit FILE`: a batch of requests from JSONL or plain text, resumable by request_id."""

from __future__ import annotations

import codecs
import functools
import hashlib
import json
from pathlib import Path
from typing import Callable

from replicadp_tasks.contract import (DEFAULTS, SCHEDULING_FIELDS, WEBHOOK_FIELDS, Accepts, InvalidRequest,
                                      repeated_key, validate_request)

from .api import check_redis, fetch_video, model_for, run_requests
from .ops.status import live_accepted
from .progress import console, flight_text, progress_bar, wait_for_replicas


class BatchFileError(Exception):
    """Raised when lines of a batch file are malformed; lists every bad line with its number."""


def request_id_for(kwargs: dict) -> str:
    """A stable id for a line without one: re-running the file finds the same ids, whatever priority, user or
    webhook it runs with this time."""
    canonical = json.dumps({k: v for k, v in kwargs.items() if k not in SCHEDULING_FIELDS + WEBHOOK_FIELDS},
                           sort_keys=True, separators=(",", ":"))
    return "req-" + hashlib.sha256(canonical.encode()).hexdigest()[:24]


def decode_batch(path: Path) -> str:
    """The file's text: UTF-8, with or without a byte order mark (which would otherwise hide the first line's
    '{' and make a JSONL file a text batch)."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise BatchFileError(f"{path}: cannot read it: {exc.strerror}") from None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        offset = exc.start + (len(codecs.BOM_UTF8) if raw.startswith(codecs.BOM_UTF8) else 0)
        line = raw.count(b"\n", 0, offset) + 1
        utf16 = raw[:2] in (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)
        raise BatchFileError(f"{path}: not UTF-8{' (a UTF-16 byte order mark starts it)' if utf16 else ''}: byte "
                             f"0x{raw[offset]:02x} at byte offset {offset} (line {line}); save the batch file as "
                             "UTF-8") from None


class DuplicateKey(Exception):
    pass


def unique_keys(pairs: list[tuple]) -> dict:
    """A JSON object's pairs as a dict, refusing a key given twice (json.loads would keep the last)."""
    twice = repeated_key(pairs)
    if twice is not None:
        raise DuplicateKey(twice)
    return dict(pairs)


def looks_like_json(line: str) -> bool:
    """A line a text batch must not take as a prompt: a JSON object (or its start), or a JSON array."""
    if line.startswith("{"):
        return True
    if line.startswith("["):
        try:
            json.loads(line)
            return True
        except ValueError:
            return False
    return False


def read_batch(path: Path, defaults: dict | None = None,
               accepted: Callable[[str | None], tuple[str, Accepts]] = lambda model: (model, Accepts())
               ) -> list[tuple[int, dict]]:
    """(line number, generate kwargs with a request_id) per request, `defaults` (priority, user, model) filling what
    a line does not say, each checked against what the live replicas of its model accept (`accepted(model)`: the
    model's name, the line's or the default, and what they accept; InvalidRequest for a model not
    served). JSONL when the first non-blank line
    starts with '{', else one prompt per line; a text batch with a line that looks like JSON is refused, not
    guessed at (a JSONL file whose first line lost its '{' would run its JSON as prompts). Every malformed line
    is reported before anything is sent."""
    # Lines end at \n, \r\n or \r only: str.splitlines also splits at U+2028 and other characters that a JSON
    # string may hold. A byte order mark starting a line is one of a file appended to another.
    text = decode_batch(path).replace("\r\n", "\n").replace("\r", "\n")
    lines = [(n, stripped) for n, line in enumerate(text.split("\n"), 1) if (stripped := line.lstrip("\ufeff").strip())]
    if not lines:
        raise BatchFileError(f"{path}: no requests (the file is empty or blank)")
    jsonl = lines[0][1].startswith("{")
    requests, errors = [], []
    for n, line in lines:
        if jsonl:
            try:
                kwargs = json.loads(line, object_pairs_hook=unique_keys)
            except json.JSONDecodeError as exc:
                errors.append(f"line {n}: not JSON ({exc.msg} at column {exc.colno})")
                continue
            except (ValueError, RecursionError) as exc:  # a number too long to convert; nesting past the decoder
                errors.append(f"line {n}: not JSON within bounds ({type(exc).__name__}: {str(exc)[:120]})")
                continue
            except DuplicateKey as exc:
                errors.append(f"line {n}: key {exc.args[0]!r} given twice; give each argument once")
                continue
            if not isinstance(kwargs, dict):
                errors.append(f"line {n}: expected a JSON object of generate arguments, got {type(kwargs).__name__}")
                continue
        elif looks_like_json(line):
            errors.append(f"line {n}: looks like JSON in a text batch (one prompt per line, since line {lines[0][0]} "
                          "does not start with '{'): in a JSONL batch every line is a JSON object")
            continue
        else:
            kwargs = {"prompt": line}
        kwargs = {**(defaults or {}), **kwargs}
        try:
            validate_request(kwargs)
        except InvalidRequest as exc:
            errors.append(f"line {n}: {exc}")
            continue
        kwargs.setdefault("request_id", request_id_for(kwargs))
        requests.append((n, kwargs))
    if not errors:  # a well-formed file: each line against its model (the replica checks again, and its webhook)
        for n, kwargs in requests:
            try:
                model, accepts = accepted(kwargs.get("model"))
                validate_request({**kwargs, "model": model}, accepts)
            except InvalidRequest as exc:
                errors.append(f"line {n}: {exc}")
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


def longest_first(requests: list, key=lambda request: request) -> list:
    """Largest requests first (stable; `key` gives an item's generate kwargs): with every request known up
    front, the short ones fill the gaps at the end instead of one long request running alone."""
    return sorted(requests, key=lambda item: work(key(item)), reverse=True)


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


def run_batch(file: Path, results: Path, *, concurrency: int, timeout: float, save_dir: Path | None,
              longest: bool = True, defaults: dict | None = None) -> int:
    """Run the requests of `file` that `results` does not record as completed, appending each outcome to
    `results` (and its video to `save_dir`) as it ends, with a progress bar; largest first unless not `longest`
    (file order). `defaults` (priority, user, model) apply to the lines that do not set them. Returns how many
    failed."""
    @functools.cache
    def accepted(asked: str | None) -> tuple[str, Accepts]:
        check_redis()
        model = model_for(asked)
        return model, live_accepted(model)

    batch = read_batch(file, defaults, accepted)
    done = completed_ids(results)
    todo = [(n, kw) for n, kw in batch if kw["request_id"] not in done]
    if longest:
        todo = longest_first(todo, key=lambda item: item[1])
    console.print(f"{len(batch)} request(s) in {file}; {len(batch) - len(todo)} already completed; "
                  f"submitting {len(todo)}")
    if not todo:
        return 0
    for model in sorted({model_for(kw.get("model")) for _, kw in todo}):
        wait_for_replicas(timeout, model)
    failed = 0
    with progress_bar() as bar, open(results, "a") as out:
        task = bar.add_task("submit", total=len(todo), flight="")

        def on_update(in_flight, finished):
            desc = f"submit: {bar.tasks[0].completed + (1 if finished else 0) - failed} done, {failed} failed"
            bar.update(task, description=desc, flight=flight_text(in_flight))

        for o in run_requests([kw for _, kw in todo], concurrency, timeout, on_update):
            line = todo[o.index][0]
            if o.ok and save_dir:
                save_dir.mkdir(parents=True, exist_ok=True)
                (save_dir / f"{o.request['request_id']}.mp4").write_bytes(fetch_video(o.result))
            failed += not o.ok
            out.write(json.dumps({"line": line, "request_id": o.request["request_id"], "ok": o.ok,
                                  "result": o.result, "error": o.error}) + "\n")
            out.flush()
            bar.advance(task)
            if not o.ok:
                console.print(f"[red]line {line} failed[/red]: {o.error}")
    console.print(f"{len(todo) - failed} completed, {failed} failed; results in {results}")
    return failed
