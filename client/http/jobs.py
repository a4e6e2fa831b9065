"""A request as the API shows it: the job object from its record and its result meta, and its MP4 answer."""

from __future__ import annotations

from datetime import datetime

from fastapi.responses import Response

from replicadp_tasks.records import READY, RequestState, Result

from .errors import failure
from .schema import VideoError, VideoJob


def date_done(meta: dict) -> int | None:
    done = meta.get("date_done")
    return int(datetime.fromisoformat(done).timestamp()) if isinstance(done, str) else None


def job_view(record: dict, meta: dict | None) -> VideoJob:
    """A job as the API shows it: its request as created, its state from the result backend. A cancelled
    job is `failed` with error code `cancelled`: the four states are what OpenAI's and vllm-omni's clients
    know."""
    job = VideoJob(status="queued", progress=0, **record)
    status = meta["status"] if meta else RequestState.PENDING
    info = meta.get("result") if meta else None
    if status == RequestState.SUCCESS:
        job.status, job.progress, job.completed_at = "completed", 100, date_done(meta)
        job.replica, job.inference_time_s = info["replica"], info["timings"]["inference_s"]
    elif status in READY:
        error = failure(meta)
        job.status, job.completed_at = "failed", date_done(meta)
        job.error = VideoError(code=error.code, message=error.detail)
    elif status in (RequestState.STARTED, RequestState.PROGRESS):
        job.status = "in_progress"
        if isinstance(info, dict):
            job.replica = info.get("replica") or info.get("hostname")  # a Progress, or Celery's STARTED meta
            if info.get("total_steps"):  # 100 only once the video is stored
                job.progress = min(99, 100 * info["step"] // info["total_steps"])
    return job


def video_response(result: Result, video: bytes) -> Response:
    """The MP4 bytes exactly as the replica stored them (bit-exact encoding: the same input gives the same
    bytes on any replica), with vllm-omni's headers, from the request's Result."""
    return Response(video, media_type="video/mp4", headers={
        "X-Request-Id": result["request_id"], "X-Model": result["model"], "X-Replica": result["replica"],
        "X-Inference-Time-S": str(result["timings"]["inference_s"])})
