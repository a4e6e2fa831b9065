"""The form both POST routes take, and how it becomes `generate`'s keyword arguments."""

from __future__ import annotations

import base64
import inspect
from collections import Counter
from dataclasses import dataclass
from typing import Annotated

from fastapi import File, Form, Request, UploadFile

from replicadp_tasks.contract import DEFAULTS, MAX_FPS, MAX_FRAMES, InvalidRequest, decode_json, parse_size
from replicadp_tasks.settings import SETTINGS

from .errors import ErrorCode, GatewayError


# The `loras` field's JSON, at most: MAX_LORAS objects {"name": ..., "scale": ...} fit many times over.
LORAS_CHARS = 4096


@dataclass(frozen=True)
class VideoForm:
    prompt: str
    size: str | None
    width: int | None
    height: int | None
    num_frames: int | None
    seconds: int | None
    fps: int | None
    num_inference_steps: int | None
    guidance_scale: float | None
    guidance_scale_2: float | None
    boundary_ratio: float | None
    seed: int | None
    negative_prompt: str | None
    model: str | None
    image: str | None  # input_reference, base64
    user: str | None
    priority: str | None
    quality: str | None
    webhook_url: str | None
    webhook_events: str | None  # comma-separated
    loras: str | None = None  # JSON: [{"name": ..., "scale": ...}, ...]


async def video_form(
    request: Request,
    prompt: Annotated[str, Form(description="What the video shows.")],
    size: Annotated[str | None, Form(description="WIDTHxHEIGHT, e.g. 832x480; or width and height.")] = None,
    width: Annotated[int | None, Form(description="Pixels; a multiple of the model's size multiple.")] = None,
    height: Annotated[int | None, Form()] = None,
    num_frames: Annotated[int | None, Form(description="Of the form 4k+1.")] = None,
    seconds: Annotated[int | None, Form(description="Without num_frames: seconds x fps frames, made 4k+1 as Wan "
                                                    "does (5 s at 24 fps: 121).")] = None,
    fps: Annotated[int | None, Form(description="Frame rate of the MP4 (default 24).")] = None,
    num_inference_steps: Annotated[int | None, Form()] = None,
    guidance_scale: Annotated[float | None, Form(description="Default: the model's (5.0; Wan2.2 T2V-A14B 4.0, "
                                                             "I2V-A14B 3.5).")] = None,
    guidance_scale_2: Annotated[float | None, Form(description="Two-expert models (Wan2.2 A14B): the low-noise "
                                                               "expert's guidance (default: the model's: 3.0 for T2V, "
                                                               "3.5 for I2V).")] = None,
    boundary_ratio: Annotated[float | None, Form(description="Two-expert models: where the experts switch, 0 to 1 "
                                                             "of the timesteps (default: the model's).")] = None,
    seed: Annotated[int | None, Form()] = None,
    negative_prompt: Annotated[str | None, Form()] = None,
    model: Annotated[str | None, Form(description="One of the models this deployment serves (GET /v1/models); "
                                                   "default: its default model (REPLICADP_DEFAULT_MODEL, else the "
                                                   "one it serves).")] = None,
    input_reference: Annotated[UploadFile | None, File(description="First frame (TI2V): an image file.")] = None,
    user: Annotated[str | None, Form(description="Who the video is for: waiting requests are served round "
                                                 "robin across users.")] = None,
    priority: Annotated[str | None, Form(description="interactive, normal (default) or batch: a replica takes "
                                                     "the highest priority waiting.")] = None,
    quality: Annotated[str | None, Form(description="standard (default): the exact path; fast: the deployment's "
                                                   "step cache, where it has one (a slightly different "
                                                   "video).")] = None,
    webhook_url: Annotated[str | None, Form(description="An http(s) URL that is POSTed the job's events, signed "
                                                        "(docs/http.md, Webhooks).")] = None,
    webhook_events: Annotated[str | None, Form(description="Comma-separated: started, progress, completed, "
                                                           "failed (default: completed,failed).")] = None,
    loras: Annotated[str | None, Form(description='The deployment\'s LoRA adapters to run with, as JSON: '
                                                  '[{"name": "style", "scale": 0.8}] (scale optional; at most 4; '
                                                  '/v1/models lists the names).')] = None,
) -> VideoForm:
    """The form as a FastAPI dependency (its parameters are the OpenAPI form schema)."""
    # A field this gateway does not know (vllm-omni's flow_shift, its lora object...) would be silently
    # ignored, giving another video than the one asked for: refuse it, as generate refuses unknown arguments.
    counts = Counter(name for name, _ in (await request.form()).multi_items())
    unknown = sorted(set(counts) - set(FORM_FIELDS))
    if unknown:
        raise GatewayError(400, f"{unknown[0]}: unknown field; accepted: {', '.join(FORM_FIELDS)}",
                           code=ErrorCode.INVALID_REQUEST, param=unknown[0])
    # A field given twice would silently take its last value (FastAPI's reading): which one was meant?
    repeated = sorted(name for name, n in counts.items() if n > 1)
    if repeated:
        raise GatewayError(400, f"{repeated[0]}: given {counts[repeated[0]]} times; give each field once",
                           code=ErrorCode.INVALID_REQUEST, param=repeated[0])
    image = None
    if input_reference is not None:
        data = await input_reference.read(SETTINGS.max_image_bytes + 1)
        if len(data) > SETTINGS.max_image_bytes:
            raise GatewayError(413, f"input_reference: more than {SETTINGS.max_image_bytes} bytes "
                                    "(REPLICADP_MAX_IMAGE_BYTES)", code=ErrorCode.TOO_LARGE, param="input_reference")
        if not data:
            raise GatewayError(400, "input_reference: empty file", code=ErrorCode.INVALID_REQUEST,
                               param="input_reference")
        image = base64.b64encode(data).decode()
    return VideoForm(prompt=prompt, size=size, width=width, height=height, num_frames=num_frames, seconds=seconds,
                     fps=fps, num_inference_steps=num_inference_steps, guidance_scale=guidance_scale,
                     guidance_scale_2=guidance_scale_2, boundary_ratio=boundary_ratio, seed=seed,
                     negative_prompt=negative_prompt, model=model, image=image, user=user, priority=priority,
                     quality=quality, webhook_url=webhook_url, webhook_events=webhook_events, loras=loras)


FORM_FIELDS = [name for name in inspect.signature(video_form).parameters if name != "request"]


def frames_for(seconds: int, fps: int) -> int:
    """The frames vllm-omni's videos have for `seconds`: it asks Wan for seconds x fps, and Wan's pipelines make
    a count that is not of the form 4k+1 into (n // 4) x 4 + 1 (5 s at 24 fps: 121 frames, at 16 fps: 81). Here the
    count is computed, and shown in the job's num_frames, before anything runs."""
    n = seconds * fps
    return n if n % 4 == 1 else n // 4 * 4 + 1


def generate_kwargs(form: VideoForm) -> dict:
    """The form as generate's keyword arguments: size into width and height, seconds into num_frames. Raises
    InvalidRequest for what only the form can get wrong; generate's own validation checks the rest."""
    width, height = form.width, form.height
    if form.size is not None:
        parsed = parse_size(form.size)
        for name, given, value in (("width", width, parsed[0]), ("height", height, parsed[1])):
            if given is not None and given != value:
                raise InvalidRequest.of("size", f"conflicts with {name}={given}", value=form.size)
        width, height = parsed
    num_frames = form.num_frames
    fps = form.fps if form.fps is not None else DEFAULTS["fps"]
    if num_frames is not None and form.seconds is not None and 1 <= fps <= MAX_FPS:
        if frames_for(form.seconds, fps) != num_frames:  # which length was meant?
            raise InvalidRequest.of("seconds", f"conflicts with num_frames={num_frames} (at fps={fps} it is "
                                               f"{frames_for(form.seconds, fps)} frames)", value=form.seconds)
    if num_frames is None and form.seconds is not None and 1 <= fps <= MAX_FPS:  # else validation names fps
        if form.seconds < 1:
            raise InvalidRequest.of("seconds", "must be at least 1", value=form.seconds)
        num_frames = frames_for(form.seconds, fps)
        if num_frames > MAX_FRAMES:
            raise InvalidRequest.of("seconds", f"at fps={fps} that is {num_frames} frames, more than {MAX_FRAMES}",
                                    value=form.seconds)
    loras = None if form.loras is None else decode_json("loras", form.loras, LORAS_CHARS)
    kwargs = {"prompt": form.prompt, "negative_prompt": form.negative_prompt, "seed": form.seed, "height": height,
              "width": width, "num_frames": num_frames, "num_inference_steps": form.num_inference_steps,
              "guidance_scale": form.guidance_scale, "guidance_scale_2": form.guidance_scale_2,
              "boundary_ratio": form.boundary_ratio, "fps": form.fps, "image": form.image, "user": form.user,
              "priority": form.priority, "quality": form.quality, "webhook": form.webhook_url,
              "webhook_events": [e.strip() for e in form.webhook_events.split(",")]
              if form.webhook_events is not None else None, "loras": loras}
    return {k: v for k, v in kwargs.items() if v is not None}
