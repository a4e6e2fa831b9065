"""What crosses a process or the wire: a request's states and the records a replica writes (JSON in Redis)."""

from __future__ import annotations

from enum import StrEnum
from typing import TypedDict


class RequestState(StrEnum):
    """A request's state in Celery's result backend: Celery's own states, plus PROGRESS (a denoising step)."""

    PENDING = "PENDING"  # queued, or unknown
    STARTED = "STARTED"  # a replica took it
    PROGRESS = "PROGRESS"  # running; its Progress says the step
    SUCCESS = "SUCCESS"  # its Result is stored
    FAILURE = "FAILURE"  # failed; the result is the exception
    RETRY = "RETRY"
    REVOKED = "REVOKED"


READY = frozenset({RequestState.SUCCESS, RequestState.FAILURE, RequestState.REVOKED})  # states that do not change


class Phase(StrEnum):
    """Where a running request is, as its replica reports it (Progress). Before the first report it is taking its
    inputs (validation, the first frame's download): Celery's STARTED."""

    LOADING_INPUTS = "loading_inputs"
    DENOISING = "denoising"  # at a step of total_steps
    DECODING = "decoding"  # the VAE turns the latents into frames (after the last step; seconds on a GPU)
    ENCODING = "encoding"  # frames to the MP4
    STORING = "storing"  # the MP4 and its Result to the output store
    PREEMPTED = "preempted"  # stopped at `step` for a request of a higher priority; queued again, to go on from there


class Progress(TypedDict):
    """A running request's report: at each change of phase, and at most every PROGRESS_EVERY_S between (tasks.py)."""

    phase: Phase
    phase_started_at: float  # unix time, the replica's clock
    step: int
    total_steps: int
    first_step: int  # the step it went on from, where a preemption stopped an earlier delivery (else 0)
    replica: str
    request_id: str
    pid: int


class Timings(TypedDict):
    queued_s: float | None  # from the send to the start (None: no send time in the message)
    inference_s: float
    dit_s: float | None  # the denoising loop's share of inference_s
    encode_s: float
    total_s: float


class Result(TypedDict, total=False):
    """A successful request's metadata, as stored beside its MP4 and returned by `generate`."""

    request_id: str
    replica: str
    device: str
    model: str  # the name of the model that made it (the replica's REPLICADP_SERVED_MODEL_NAME)
    params: dict  # GenerateRequest.params(): every input that changes the output, the image by its hash
    input_key: str  # sha256 of params and model (validate.input_key)
    frames_sha256: str
    video_sha256: str
    timings: Timings
    dit_flops: int | None
    peak_memory_gib: float | None
    served: dict  # what of the deployment changed the output besides the inputs (PipelineHolder.served): the step
    # cache that a fast request ran with ({"cache": "mag threshold=0.06"}), a layout over several ranks
    # ({"parallel": "cfg:2,ring:2"}), a quantized transformer; {}: the exact path on one process
    execution: str  # the FenceToken of the delivery that computed it
    redelivered: bool  # the message came back (a process that held it ended), or this delivery returned a result
    # that another (or an earlier one) stored
    video_uri: str  # file://..., redis-key:... or s3://bucket/key (set by the store)
    video_url: str  # s3 only: a presigned GET URL of the MP4, made as the result is handed out (store.with_video_url)
    video_url_expires_at: int  # s3 only: when video_url stops working (unix seconds)


class ReplicaInfo(TypedDict):
    """What a replica serves, under REPLICA_KEY + name once its model is loaded."""

    name: str
    model: str  # the name requests give for it (REPLICADP_SERVED_MODEL_NAME), its queue's
    checkpoint: str  # what it loaded: its spec (tiny, a folder, a hub id)
    device: str
    size_multiple: int
    accepts_image: bool
    requires_image: bool  # an image-to-video model (Wan2.2-I2V-A14B): a request without `image` is refused
    experts: int  # transformers of its model: 2 for Wan2.2 A14B (guidance_scale_2, boundary_ratio), else 1
    attention: str
    compile: str
    deterministic: bool
    qualities: list[str]  # what a request's `quality` may be here (step_cache.Quality)
    cache: str  # the step cache fast requests run with (step_cache.StepCache), "none" without
    quantize: str  # the transformer's quantization (quantization.Quantize)
    loras: list[dict]  # the registered adapters a request may name: name, source, scale, experts, sha256, recipe
    fused: list[dict]  # the adapters fused into its weights at load, as `loras` lists them (a few-step model's)
    recipe: dict | None  # its model's sampling recipe (contract/recipe.py, Recipe.to_wire), None for none
    offload: str  # where the models it is not running wait (memory.Offload)
    parallel: str  # how its ranks split a request (parallel.Layout), "none" for one process
    pid: int
    load_s: float
    loaded_at: float
