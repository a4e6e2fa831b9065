"""One request from the command line: `replicadp generate` (send it, show its denoising steps, write its MP4),
`get` (a request's state, result and video by its id) and `cancel`.

A request's id is its Celery task id. Its state is its result in the backend; a request with no result yet is
queued when its message waits in the queue (or is held by a replica that has not started it), else unknown."""

from __future__ import annotations

import json
from contextlib import closing
from enum import StrEnum
from pathlib import Path
from typing import TypedDict

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from replicadp_tasks import app
from replicadp_tasks.cluster import fleet
from replicadp_tasks.contract import READY, Phase, RequestState, Result, keys, queue_for, queue_lists
from replicadp_tasks.settings import SETTINGS

from .api import (ClientError, Outcome, cancel_request, check_redis, error_message, fetch_video, live_replicas,
                  preempt_request, redacted, redis_url, run_requests)


class Status(StrEnum):
    """A request as `get` shows it."""

    QUEUED = "queued"  # waiting in the queue, or held by a replica that has not started it
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"  # failed, cancelled or timed out
    UNKNOWN = "unknown"  # never sent to this Redis, or its result expired (REPLICADP_RESULT_TTL)


class RequestStatus(TypedDict):
    """What `get --json` prints."""

    id: str
    status: Status
    replica: str | None  # running or completed: where
    phase: str | None  # running: records.Phase, where it is (None until its first report)
    step: int | None  # running: the denoising step last reported
    total_steps: int | None
    result: Result | None  # completed
    error: str | None  # failed


def need_a_replica(model: str | None = None) -> None:
    """ClientError unless a replica (of `model`, if given) is live."""
    if not live_replicas(model=model):
        raise ClientError(f"no live replica{'' if model is None else f' of {model!r}'} on {redacted(redis_url())}: "
                          "start some with `replicadp up` or worker_launch.sh")


def generate_one(request: dict, *, timeout: float, output: Path | None, err: Console) -> Outcome:
    """Send `request` to the live replicas and wait for it, with a bar over its denoising steps on `err`; write
    its MP4 to `output`. A request that times out or is interrupted is cancelled: nobody would collect it.
    ClientError when Redis is unreachable or no replica is live."""
    check_redis()
    need_a_replica(request.get("model"))
    sent: list[str] = []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err, transient=True) as bar:
        steps = bar.add_task("sending", total=None)

        def on_update(in_flight, finished):
            if in_flight:
                f = in_flight[0]
                if not sent:
                    sent.append(f.outcome.task_id)
                    err.print(f"request {f.outcome.task_id} sent", highlight=False)
                where = f" on {f.replica}" if f.replica else ""
                bar.update(steps, description=f"{(f.phase or f.state).lower().replace('_', ' ')}{where}",
                           completed=f.step, total=f.total_steps or None)

        try:
            with closing(run_requests([request], timeout=timeout, on_update=on_update)) as outcomes:
                outcome = next(outcomes)
        except (KeyboardInterrupt, SystemExit):  # Ctrl-C, or SIGTERM (cli.py makes it a SystemExit)
            if sent:
                cancel_request(sent[0])
                err.print(f"interrupted: request {sent[0]} cancelled")
            raise
    if not outcome.ok:
        cancel_request(outcome.task_id)  # it timed out (an ended request is left as it is)
    elif output is not None:
        output.write_bytes(fetch_video(outcome.result))
    return outcome


def summary(outcome: Outcome, output: Path | None) -> str:
    """Two lines on a completed request: what it made, where and how long it took; where its video is."""
    r = outcome.result
    p, t = r["params"], r["timings"]
    queued = f"queued {t['queued_s']:.1f} s, " if t.get("queued_s") is not None else ""
    return (f"completed {outcome.task_id} on {r['replica']} ({r['model']}, {r['device']}): {p['width']}x"
            f"{p['height']}, {p['num_frames']} frames, {p['num_inference_steps']} steps, seed {p['seed']} in "
            f"{outcome.latency_s:.1f} s ({queued}inference {t['inference_s']:.1f} s)\n"
            + (f"wrote {output}" if output is not None else f"video: {r['video_uri']}"))


def _carries(raw: bytes, task_id: str, wrapped: bool) -> bool:
    """Whether a raw kombu message (`wrapped`: an unacked entry, [message, exchange, routing key]) is `task_id`'s."""
    try:
        message = json.loads(raw)
        return (message[0] if wrapped else message)["headers"]["id"] == task_id
    except (ValueError, LookupError, TypeError):  # not a request message: not this one
        return False


def _waiting(task_id: str) -> bool:
    """Whether `task_id`'s message is in the queue, or delivered to a replica and not yet acknowledged."""
    client = app.backend.client
    queues = [queue_for(SETTINGS.queue, model) for model in fleet.served(client, SETTINGS.models)]
    lists = [client.lrange(key, 0, -1) for queue in queues for key in queue_lists(queue)]
    return (any(_carries(raw, task_id, wrapped=False) for raws in lists for raw in raws)
            or any(_carries(raw, task_id, wrapped=True) for raw in client.hvals(keys.UNACKED_KEY)))


def status_of(task_id: str) -> RequestStatus:
    """The state of request `task_id` on this process's Redis. ClientError when Redis is unreachable."""
    check_redis()
    meta = app.backend.get_task_meta(task_id)
    state, info = meta["status"], meta.get("result")
    view = RequestStatus(id=task_id, status=Status.UNKNOWN, replica=None, phase=None, step=None, total_steps=None,
                         result=None, error=None)
    if state == RequestState.SUCCESS:
        view.update(status=Status.COMPLETED, replica=info["replica"], result=info)
    elif state in READY:
        view.update(status=Status.FAILED, error=error_message(info))
    elif state != RequestState.PENDING:  # STARTED, PROGRESS (a Progress), RETRY
        view["status"] = Status.RUNNING
        if isinstance(info, dict):
            view.update(replica=info.get("replica") or info.get("hostname"), phase=info.get("phase"),
                        step=info.get("step"), total_steps=info.get("total_steps"))
            if view["phase"] == Phase.PREEMPTED:  # queued again, to go on from its step
                view["status"] = Status.QUEUED
    elif _waiting(task_id):
        view["status"] = Status.QUEUED
    return view


def cancel(task_id: str) -> RequestStatus:
    """Cancel request `task_id` unless it has ended or is unknown; returns its state before the cancel."""
    view = status_of(task_id)
    if view["status"] in (Status.QUEUED, Status.RUNNING):
        cancel_request(task_id)
    return view


def describe(view: RequestStatus) -> str:
    """One line on a request's state, for people."""
    rid, status = view["id"], view["status"]
    if status == Status.COMPLETED:
        return f"{rid}: completed on {view['replica']}; video: {view['result']['video_uri']}"
    if status == Status.FAILED:
        return f"{rid}: failed: {view['error']}"
    if status == Status.RUNNING:
        step = f", step {view['step']}/{view['total_steps']}" if view["total_steps"] else ""
        if view["phase"] not in (None, Phase.DENOISING):
            step = f", {view['phase']}"  # past its last step: decoding, encoding, storing
        return f"{rid}: running on {view['replica'] or '?'}{step}"
    if status == Status.QUEUED and view["phase"] == Phase.PREEMPTED:
        return (f"{rid}: queued again: preempted on {view['replica'] or '?'} at step {view['step']}/"
                f"{view['total_steps']}, to go on from there")
    if status == Status.QUEUED:
        return f"{rid}: queued"
    return (f"{rid}: unknown on {redacted(redis_url())}: never sent there, or its result expired "
            f"(REPLICADP_RESULT_TTL={SETTINGS.result_ttl_s} s)")


def preempt(task_id: str) -> RequestStatus:
    """Preempt request `task_id` if it is running its denoising steps; returns its state before."""
    view = status_of(task_id)
    if view["status"] == Status.RUNNING and view["phase"] in (None, Phase.DENOISING):
        preempt_request(task_id)
    return view


def describe_preempt(view: RequestStatus) -> str:
    """What `preempt` did, from the request's state before it."""
    rid, status = view["id"], view["status"]
    if status == Status.RUNNING and view["phase"] in (None, Phase.DENOISING):
        return (f"{rid}: preempted; it stops at its next denoising step on {view['replica'] or '?'} and is queued "
                "again, to go on from there")
    if status == Status.UNKNOWN:
        return describe(view) + "; nothing preempted"
    return describe(view) + "; nothing to preempt: it is not denoising"


def describe_cancel(view: RequestStatus) -> str:
    """What `cancel` did, from the request's state before it."""
    rid, status = view["id"], view["status"]
    if status == Status.QUEUED:
        return f"{rid}: cancelled; it was queued and will not run"
    if status == Status.RUNNING:
        return f"{rid}: cancelled; it was running on {view['replica'] or '?'} and stops at its next denoising step"
    if status == Status.UNKNOWN:
        return describe(view) + "; nothing cancelled"
    return f"{rid}: nothing to cancel, it has ended ({status})"
