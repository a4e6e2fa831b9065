"""The response bodies: OpenAI's and vllm-omni's video API objects, which are also the OpenAPI schema."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel


class VideoError(BaseModel):
    code: str
    message: str


# Where a job is, finer than its status: queued, a running request's phase (records.Phase), cancelling (deleted
# while it runs, until its replica stops), or how it ended.
JobPhase = Literal["queued", "preempted", "loading_inputs", "denoising", "decoding", "encoding", "storing",
                   "cancelling", "completed", "failed", "cancelled"]


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
    priority: str = "normal"  # what it waits behind (scheduling.Priority)
    phase: JobPhase = "queued"
    step: int | None = None  # the denoising step reached, of total_steps (the record `progress` comes from)
    total_steps: int | None = None
    elapsed_s: float | None = None  # seconds since created_at, until it ended
    phase_elapsed_s: float | None = None  # seconds in its phase so far; None: unknown
    queue_position: int | None = None  # queued: 1 = the next request a replica takes (higher priorities counted)
    expected_start_s: float | None = None  # queued: seconds until it starts, estimated (docs/ui.md); None: unknown
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
    # Once completed, from the Result: the effective inputs (validate.GenerateRequest.params: the first frame by
    # its hash) and the output's identity, so that a client can re-run a video and check it gets the same one.
    seed: int | None = None
    params: dict | None = None
    frames_sha256: str | None = None
    video_sha256: str | None = None


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


class VideoLinks(BaseModel):
    """Where a `<video>` or `<img>` reads a completed job's files: with API keys, links signed by the key that
    asked, good without a header until `expires_at` (unix seconds); without keys, their plain paths (None)."""
    object: Literal["video.links"] = "video.links"
    content: str
    poster: str
    expires_at: int | None


class ModelReplica(BaseModel):
    name: str
    qualities: list[str]  # what a request's `quality` may be on it
    fast_path: str | None  # the step cache quality=fast runs with ("mag threshold=0.06"); None: it serves no fast path
    loras: list[str] = []  # the LoRA adapters a request may name on it (the form's `loras`)
    fused: list[str] = []  # the adapters fused into its weights (a few-step model's)
    recipe: str | None = None  # its sampling recipe (a few-step model's: steps, guidance, scheduler), None for none


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "replicadp"
    replicas: list[ModelReplica] = []  # the live replicas serving it; none: its requests wait for one
    queue_depth: int = 0  # requests waiting in its queue


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok", "unavailable"]
    replicas: list[str]
    queue_depth: int


class RunningRequest(BaseModel):
    id: str | None  # the job id (a gateway job's request_id is its id); None: not the caller's (only busy)
    step: int | None  # None until its first denoising step
    total_steps: int | None
    prompt: str | None = None  # the caller's own request only
    phase: JobPhase | None = None  # the caller's own request only: as its job says


class ReplicaStatus(BaseModel):
    name: str
    device: str | None
    model: str | None
    accepts_image: bool
    qualities: list[str] | None  # the fidelities it serves (the form's `quality`); None: it offers no choice
    size_multiple: int | None
    loras: list[str] = []  # the LoRA adapters a request may name on it (the form's `loras`)
    serving: bool  # False while it loads its model
    running: RunningRequest | None


class CostModel(BaseModel):
    """What a request takes on a replica by its size, from recent completed jobs (docs/ui.md): fixed_s +
    per_unit_s x units, units = width x height x num_frames / 1e6 x num_inference_steps (megapixel-frame-steps);
    fitted to jobs of min_units to max_units, so a guess far outside that range is no estimate."""

    fixed_s: float
    per_unit_s: float
    min_units: float
    max_units: float


class ModelStatus(BaseModel):
    """One model the deployment serves, as the web page's form and queue show it (docs/ui.md)."""

    id: str
    queue_by_priority: dict[str, int]  # requests waiting for it, per priority (cancelled ones, never run, left out)
    # per priority: seconds until a request for it queued now starts; None: unknown
    expected_wait_s: dict[str, float | None]
    mean_request_s: float | None  # the mean replica time of its recent completed jobs; None: none completed lately
    request_cost: CostModel | None  # what a request of a given size takes on it, at the recent jobs' pace
    load: float  # how much longer steps take now than request_cost says (the requests running tell): 1, as long
    after_steps_s: float | None  # what followed the last step lately (decode, encode, store); None: not measured
    defaults: dict[str, str | int | float]  # what a request to it leaves out gets (its recipe's steps and guidance)
    recipe: str | None = None  # its sampling recipe in a line (a few-step model's); None: none
    fixed: list[str] = []  # the fields its recipe fixes: a request may give no other value
    final: str | None = None  # a few-step model: the exact model beside it (the same checkpoint), for a final


class ClusterStatus(BaseModel):
    """GET /v1/status: what the web page shows live (docs/ui.md)."""

    replicas: list[ReplicaStatus]
    queue_depth: int
    queue_by_priority: dict[str, int]  # interactive, normal, batch
    mean_request_s: float | None  # the mean replica time of recent completed jobs; None: none completed lately
    # per priority: seconds until a request queued now at it starts (docs/ui.md); None: unknown
    expected_wait_s: dict[str, float | None]
    # what a request leaves out gets: size, num_frames, num_inference_steps, guidance_scale, fps
    defaults: dict[str, str | int | float] = {}
    # what a request of a given size takes, from the same recent jobs; None: none completed lately
    request_cost: CostModel | None = None
    # every model served (the figures above are the default model's: the one a request naming none runs on)
    models: list[ModelStatus] = []
    default_model: str | None = None  # None: several served and none the default (a request must name one)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str


class ErrorBody(BaseModel):  # OpenAI's error object: every error answer (no docstring: it would enter the schema)
    error: ErrorDetail


# The error answers a route may give, for its OpenAPI `responses`.
ERRORS = {code: {"model": ErrorBody} for code in (400, 401, 404, 409, 413, 422, 429, 502, 503, 504)}
