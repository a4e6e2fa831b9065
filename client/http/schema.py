"""The response bodies: OpenAI's and vllm-omni's video API objects, which are also the OpenAPI schema."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel


class VideoError(BaseModel):
    code: str
    message: str


class VideoJob(BaseModel):
    """OpenAI's and vllm-omni's video job object, plus what the replica reported."""

    id: str
    object: Literal["video"] = "video"
    model: str
    status: Literal["queued", "in_progress", "completed", "failed"]
    progress: int
    created_at: int
    completed_at: int | None = None
    size: str
    seconds: str
    num_frames: int
    fps: int
    prompt: str
    expires_at: int | None = None  # when the store's retention (REPLICADP_STORE_TTL) removes the video
    error: VideoError | None = None
    replica: str | None = None
    inference_time_s: float | None = None
    stage_durations: dict[str, float] | None = None  # seconds: queued, inference, dit, encode, total
    peak_memory_mb: float | None = None  # the replica's peak (CUDA allocator, or max RSS on CPU)
    media_type: Literal["video/mp4"] = "video/mp4"
    # REPLICADP_STORE=s3: a presigned GET URL of the MP4, made as the job is read, and when it expires (unix s)
    video_url: str | None = None
    video_url_expires_at: int | None = None


JobOrder = Literal["asc", "desc"]  # GET /v1/videos?order=: by creation time


class VideoList(BaseModel):
    object: Literal["list"] = "list"
    data: list[VideoJob]
    first_id: str | None
    last_id: str | None
    has_more: bool


class VideoDeleted(BaseModel):
    id: str
    object: Literal["video.deleted"] = "video.deleted"
    deleted: bool


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "replicadp"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok", "unavailable"]
    replicas: list[str]
    queue_depth: int


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str


class ErrorBody(BaseModel):  # OpenAI's error object: every error answer (no docstring: it would enter the schema)
    error: ErrorDetail


# The error answers a route may give, for its OpenAPI `responses`.
ERRORS = {code: {"model": ErrorBody} for code in (400, 401, 404, 409, 413, 422, 429, 502, 503, 504)}
