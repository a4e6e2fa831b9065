"""Validation of `generate` arguments, before anything reaches the model.

Every error names the field and the value. Nothing is rounded or clamped: diffusers silently floors bad
sizes and frame counts, which would hand the caller a video other than the one asked for.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import asdict, dataclass

from .errors import InvalidRequest
from .keys import REQUEST_ID_RE
from .scheduling import check_priority, check_tenant, check_user
from ..model.step_cache import Quality
from ..webhooks.events import check_webhook

# generate's defaults are the reference workload (vllm-omni's replica-DP recipe): 832x480, 33 frames, 30 steps.
# The bench, the CLI and the FLOP counts take it from here.
DEFAULTS = {
    "negative_prompt": "",
    "seed": 0,
    "height": 480,
    "width": 832,
    "num_frames": 33,
    "num_inference_steps": 30,
    "guidance_scale": 5.0,
    "fps": 24,
    "max_sequence_length": 512,
    "image": None,
    "request_id": None,
    "quality": Quality.STANDARD,  # the exact path; "fast" runs the deployment's step cache (step_cache.py)
    # Two-expert models only (Wan2.2 A14B): the low-noise expert's guidance (None: guidance_scale), and where the
    # experts switch, as a share of the training timesteps (None: the model's own boundary_ratio).
    "guidance_scale_2": None,
    "boundary_ratio": None,
    # The deployment's registered LoRA adapters this request runs with, and their scales (adapters.py):
    # [{"name": ..., "scale": ...}, ...]; none by default.
    "loras": None,
}
# Unset, these are left out of a request's params (and so of its identity): requests made before they existed, or
# to one-expert models, or without adapters, keep their identity.
TWO_EXPERT_FIELDS = ("guidance_scale_2", "boundary_ratio")
OPTIONAL_FIELDS = (*TWO_EXPERT_FIELDS, "loras")
# Where the request waits, not what it makes (scheduling.py): checked here, never part of its identity.
SCHEDULING_FIELDS = ("priority", "tenant", "user")
# How the request is told of its events (webhooks.py), not what it makes: checked here, never part of its identity.
WEBHOOK_FIELDS = ("webhook", "webhook_events")
FIELDS = ("prompt", *DEFAULTS, *SCHEDULING_FIELDS, *WEBHOOK_FIELDS)
REFERENCE_SIZE = f"{DEFAULTS['width']}x{DEFAULTS['height']}"
REFERENCE_WORK = DEFAULTS["height"] * DEFAULTS["width"] * DEFAULTS["num_frames"] * DEFAULTS["num_inference_steps"]

MAX_SIDE = 4096
MAX_FRAMES = 1025
MAX_STEPS = 200
MAX_GUIDANCE = 20.0
MAX_FPS = 120
MAX_SEQUENCE_LENGTH = 512
MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class GenerateRequest:
    """The validated inputs of one request. Every field that changes the output is here."""

    prompt: str
    negative_prompt: str
    seed: int
    height: int
    width: int
    num_frames: int
    num_inference_steps: int
    guidance_scale: float
    fps: int
    max_sequence_length: int
    image: str | None
    request_id: str | None
    quality: Quality
    guidance_scale_2: float | None = None
    boundary_ratio: float | None = None
    loras: tuple[tuple[str, float | None], ...] = ()  # (name, scale) by name; a scale of None: the adapter's own

    def params(self, image_sha256: str | None = None) -> dict:
        """The effective inputs as reported back: the image by its hash, not its (possibly huge) bytes; the
        two-expert fields only where set."""
        p = asdict(self)
        del p["request_id"], p["image"]
        p["loras"] = [{"name": name, "scale": scale} for name, scale in self.loras] or None
        for field in OPTIONAL_FIELDS:
            if p[field] is None:
                del p[field]
        p["image_sha256"] = image_sha256
        return p


def input_key(params: dict, model: str, served: dict | None = None) -> str:
    """Identity of an input: every argument that changes the output, plus the model, plus what else about the
    deployment changes it (`served`: the step cache of a fast request, a quantized transformer)."""
    canonical = json.dumps({**params, "model": model, **({"served": served} if served else {})}, sort_keys=True,
                           separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def parse_size(text: str, field: str = "size") -> tuple[int, int]:
    """`WIDTHxHEIGHT` (e.g. 832x480) as (width, height), both positive; else InvalidRequest naming `field`."""
    width, sep, height = text.lower().partition("x") if isinstance(text, str) else ("", "", "")
    if not (sep and width.isascii() and width.isdigit() and height.isascii() and height.isdigit()
            and int(width) > 0 and int(height) > 0):
        raise InvalidRequest.of(field, f"expected WIDTHxHEIGHT, e.g. {REFERENCE_SIZE}", value=text)
    return int(width), int(height)


def _fail(field: str, value, why: str):
    raise InvalidRequest.of(field, why, value=value)


def _int(field: str, value, lo: int, hi: int) -> int:
    # bool is an int in Python; a JSON `true` for a frame count is a client bug, not a 1.
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(field, value, f"must be an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        _fail(field, value, f"must be between {lo} and {hi}")
    return value


def _float(field: str, value, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _fail(field, value, f"must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        _fail(field, value, "must be a finite number")
    if not lo <= value <= hi:
        _fail(field, value, f"must be between {lo} and {hi}")
    return float(value)


# C0 control characters (and DEL) other than tab and newlines: never part of a prompt, often an attack on logs
# and terminals. Refused, not stripped: no silent fix-up.
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def _text(field: str, value, max_chars: int, required: bool) -> str:
    if not isinstance(value, str):
        _fail(field, value, f"must be a string, got {type(value).__name__}")
    bad = _CONTROL.search(value)
    if bad:
        _fail(field, value, f"control character {bad.group()!r} at position {bad.start()}; only tab and newlines are allowed")
    if required and not value.strip():
        _fail(field, value, "must not be empty")
    if len(value) > max_chars:
        _fail(field, value, f"is {len(value)} characters long; the limit is {max_chars}")
    return value


def check_loras(value, registered: dict[str, float] | None = None) -> tuple[tuple[str, float | None], ...]:
    """A request's `loras`: a list of at most MAX_LORAS {"name", "scale"} objects, names of registered adapters
    (`registered`: name -> default scale; None: unknown here, the replica checks), each once, |scale| at most
    MAX_SCALE (left out: the adapter's default). Returns (name, scale) pairs sorted by name: the order they are
    applied in and part of the identity. InvalidRequest naming `loras` otherwise."""
    from ..model.adapters import MAX_LORAS, MAX_SCALE, NAME_RE, is_scale

    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_LORAS:
        _fail("loras", value, f"must be a list of at most {MAX_LORAS} objects {{\"name\": ..., \"scale\": ...}}")
    pairs = {}
    for entry in value:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or set(entry) - {"name", "scale"}:
            _fail("loras", value, 'each entry must be an object {"name": ..., "scale": ...} (scale optional)')
        name, scale = entry["name"], entry.get("scale")
        if not NAME_RE.fullmatch(name) or (registered is not None and name not in registered):
            known = "none" if not registered else ", ".join(sorted(registered))
            _fail("loras", name, f"no such adapter here; registered: {known}" if registered is not None else
                  "is not an adapter's name (1-64 of a-z, 0-9, '_', '.', '-')")
        if name in pairs:
            _fail("loras", name, "is named twice")
        if scale is not None and not is_scale(scale):
            _fail("loras", scale, f"a scale must be a number from -{MAX_SCALE:g} to {MAX_SCALE:g}")
        if scale is None and registered is not None:
            scale = registered[name]
        pairs[name] = None if scale is None else float(scale)
    return tuple(sorted(pairs.items()))


def validate_request(kwargs: dict, *, size_multiple: int = 16, max_prompt_chars: int = 4000,
                     max_work: int | None = None, webhook_policy: bool = True,
                     qualities: list[str] | None = None, experts: int | None = None,
                     requires_image: bool = False, defaults: dict | None = None,
                     loras: dict[str, float] | None = None) -> GenerateRequest:
    """Check `generate`'s keyword arguments and return them with defaults filled in.

    `size_multiple` is what the loaded model needs (16 for Wan2.1, 32 for Wan2.2-TI2V-5B); `max_work` is the
    deployment's budget for height x width x num_frames x num_inference_steps; `webhook_policy=False` checks a
    webhook's form only, not what this deployment allows (for a producer without its settings: the replica checks);
    `qualities`: the paths the replica serves (None: any, the replica checks); `experts`: the transformers of the
    model (1 refuses guidance_scale_2 and boundary_ratio; None: unknown, the replica checks); `requires_image`: an
    image-to-video model, which refuses a request without `image`; `defaults`: the model's own over DEFAULTS for
    what the request leaves out (PipelineHolder.request_defaults); `loras`: the registered adapters, name -> default
    scale (None: unknown, the replica checks). Raises InvalidRequest naming the first bad field.
    """
    unknown = sorted(set(kwargs) - set(FIELDS))
    if unknown:
        _fail(unknown[0], kwargs[unknown[0]], f"unknown argument; accepted: {', '.join(FIELDS)}")
    if "prompt" not in kwargs or kwargs["prompt"] is None:
        _fail("prompt", None, "is required")
    check_priority(kwargs.get("priority"))
    check_tenant(kwargs.get("tenant"))
    check_user(kwargs.get("user"))
    v = {**DEFAULTS, **(defaults or {}), **{k: x for k, x in kwargs.items()
                        if x is not None and k not in SCHEDULING_FIELDS + WEBHOOK_FIELDS}}

    for side in ("height", "width"):
        _int(side, v[side], size_multiple, MAX_SIDE)
        if v[side] % size_multiple:
            _fail(side, v[side], f"must be a multiple of {size_multiple} for this model")
    _int("num_frames", v["num_frames"], 1, MAX_FRAMES)
    if (v["num_frames"] - 1) % 4:
        _fail("num_frames", v["num_frames"], "must be of the form 4k+1 (1, 5, 9, ..., 33, ...)")
    if v["quality"] not in list(Quality):
        _fail("quality", v["quality"], f"must be one of {', '.join(Quality)}")
    if qualities is not None and v["quality"] not in qualities:
        _fail("quality", v["quality"], f"not served here: these replicas serve {', '.join(qualities)} only (their "
                                       "deployment has no step cache: REPLICADP_CACHE=none)")
    request_id = v["request_id"]
    if request_id is not None and (not isinstance(request_id, str) or not REQUEST_ID_RE.fullmatch(request_id)):
        _fail("request_id", request_id, "must be 1-128 characters of letters, digits, '_', '.', '-', starting with a letter or digit")
    for field in TWO_EXPERT_FIELDS:
        if v[field] is not None and experts == 1:
            _fail(field, v[field], "this model has one expert: only two-expert models (Wan2.2 A14B) take it")
    image = v["image"]
    if image is not None and (not isinstance(image, str) or not image):
        _fail("image", image, "must be a non-empty string (a path, an http(s) URL or base64)")
    if image is None and requires_image:
        raise InvalidRequest.of("image", "this model is image-to-video and needs a first frame")

    req = GenerateRequest(
        prompt=_text("prompt", v["prompt"], max_prompt_chars, required=True),
        negative_prompt=_text("negative_prompt", v["negative_prompt"], max_prompt_chars, required=False),
        seed=_int("seed", v["seed"], 0, MAX_SEED),
        height=v["height"],
        width=v["width"],
        num_frames=v["num_frames"],
        num_inference_steps=_int("num_inference_steps", v["num_inference_steps"], 1, MAX_STEPS),
        guidance_scale=_float("guidance_scale", v["guidance_scale"], 0.0, MAX_GUIDANCE),
        fps=_int("fps", v["fps"], 1, MAX_FPS),
        max_sequence_length=_int("max_sequence_length", v["max_sequence_length"], 1, MAX_SEQUENCE_LENGTH),
        image=image,
        request_id=request_id,
        quality=Quality(v["quality"]),
        guidance_scale_2=None if v["guidance_scale_2"] is None else _float(
            "guidance_scale_2", v["guidance_scale_2"], 0.0, MAX_GUIDANCE),
        boundary_ratio=None if v["boundary_ratio"] is None else _float(
            "boundary_ratio", v["boundary_ratio"], 0.0, 1.0),
        loras=check_loras(v["loras"], loras),
    )
    work = req.height * req.width * req.num_frames * req.num_inference_steps
    if max_work is not None and work > max_work:
        _fail("height x width x num_frames x num_inference_steps",
              f"{req.height}x{req.width}x{req.num_frames}x{req.num_inference_steps}",
              f"= {work} is over this deployment's budget REPLICADP_MAX_WORK={max_work}")
    # Last: its address check looks the host up.
    check_webhook(kwargs.get("webhook"), kwargs.get("webhook_events"), policy=webhook_policy)
    return req
