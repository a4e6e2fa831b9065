"""A request as the API shows it: the job object from its record and its result meta, and its MP4 answer."""

from __future__ import annotations

import json
import time
from datetime import datetime

from fastapi.responses import Response

from replicadp_tasks.contract import READY, Phase, RequestState, Result
from replicadp_tasks.settings import SETTINGS

from ..api import with_fresh_url
from .errors import ErrorCode, failure
from .schema import VideoError, VideoJob


def done_at(meta: dict) -> float | None:
    """When a request ended (unix seconds), from its result meta."""
    done = meta.get("date_done")
    return datetime.fromisoformat(done).timestamp() if isinstance(done, str) else None


def date_done(meta: dict) -> int | None:
    done = done_at(meta)
    return None if done is None else int(done)


def job_view(record: dict, meta: dict | None, now: float | None = None) -> VideoJob:
    """A job as the API shows it: its request as created, its state from the result backend. A cancelled
    job is `failed` with error code `cancelled`: the four states are what OpenAI's and vllm-omni's clients
    know; `phase` says more (schema.JobPhase): a preempted one is `queued` again, at the step it goes on from. A
    job deleted while it ran (its record's `cancelled_at`) is `cancelling` until its request ends, then
    cancelled, whatever the replica made of it (the gateway removes a video stored meanwhile:
    Gateway.watch_cancelled, and routes.shown at each read)."""
    now = time.time() if now is None else now
    job = VideoJob(status="queued", progress=0, **{k: v for k, v in record.items()
                                                   if k not in ("cancelled_at", "admitted_at")})
    status = meta["status"] if meta else RequestState.PENDING
    info = meta.get("result") if meta else None
    ended_at = done_at(meta) if status in READY else None
    if "cancelled_at" in record and status in READY:
        job.status, job.phase, job.completed_at = "failed", "cancelled", date_done(meta)
        job.error = VideoError(code=ErrorCode.CANCELLED, message=f"video_id={record['id']!r} was deleted while it "
                                                                 "ran")
    elif status == RequestState.SUCCESS:
        job.status, job.phase, job.progress, job.completed_at = "completed", "completed", 100, date_done(meta)
        job.replica, job.inference_time_s = info["replica"], info["timings"]["inference_s"]
        job.stage_durations, job.peak_memory_mb = stage_durations(info), peak_memory_mb(info)
        job.params, job.frames_sha256, job.video_sha256 = info.get("params"), info.get("frames_sha256"), info.get(
            "video_sha256")
        job.seed = job.params.get("seed") if job.params else None
        steps = (job.params or {}).get("num_inference_steps")
        job.step, job.total_steps = steps, steps
        signed = with_fresh_url(info)
        job.video_url, job.video_url_expires_at = signed.get("video_url"), signed.get("video_url_expires_at")
        if SETTINGS.store_ttl_s and job.completed_at is not None:
            job.expires_at = job.completed_at + SETTINGS.store_ttl_s
    elif status in READY:
        error = failure(meta)
        job.status, job.completed_at = "failed", date_done(meta)
        job.phase = "cancelled" if error.code == ErrorCode.CANCELLED else "failed"
        job.error = VideoError(code=error.code, message=error.detail)
    elif status in (RequestState.STARTED, RequestState.PROGRESS):
        job.status, job.phase = "in_progress", "loading_inputs"
        if isinstance(info, dict):
            job.replica = info.get("replica") or info.get("hostname")  # a Progress, or Celery's STARTED meta
            if info.get("phase"):
                job.phase = info["phase"]
                job.phase_elapsed_s = round(max(0.0, now - info["phase_started_at"]), 1)
            if info.get("total_steps"):  # 100 only once the video is stored
                job.step, job.total_steps = info["step"], info["total_steps"]
                job.progress = min(99, 100 * info["step"] // info["total_steps"])
            if job.phase == Phase.PREEMPTED:  # queued again, to go on from its step (its place in the queue too)
                job.status = "queued"
    if "cancelled_at" in record and status not in READY:
        job.phase, job.phase_elapsed_s = "cancelling", round(max(0.0, now - record["cancelled_at"]), 1)
    job.elapsed_s = round(max(0.0, (ended_at or now) - record.get("admitted_at", job.created_at)), 1)
    return job


def stage_durations(result: Result) -> dict[str, float]:
    """vllm-omni's stage_durations from the Result's timings: seconds per stage, the ones measured."""
    return {name.removesuffix("_s"): value for name, value in result["timings"].items() if value is not None}


def peak_memory_mb(result: Result) -> float | None:
    gib = result.get("peak_memory_gib")
    return round(gib * 1024, 1) if gib is not None else None


def video_response(result: Result, video: bytes) -> Response:
    """The MP4 bytes exactly as the replica stored them (bit-exact encoding: the same input gives the same
    bytes on any replica), with vllm-omni's headers, from the request's Result."""
    headers = {"X-Request-Id": result["request_id"], "X-Model": result["model"], "X-Replica": result["replica"],
               "X-Inference-Time-S": str(result["timings"]["inference_s"]),
               "X-Stage-Durations": json.dumps(stage_durations(result), separators=(",", ":"))}
    peak = peak_memory_mb(result)
    if peak is not None:  # unmeasured (the synthetic backend): no header rather than a 0
        headers["X-Peak-Memory-MB"] = str(peak)
    return Response(video, media_type="video/mp4", headers=headers)
