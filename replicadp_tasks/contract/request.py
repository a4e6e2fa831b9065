"""A request: `generate`'s arguments, their defaults, and their validation, before anything reaches the model.

Every error names the field and the value. Nothing is rounded or clamped: diffusers silently floors bad
sizes and frame counts, which would hand the caller a video other than the one asked for. What a model accepts
(its size multiple, experts, first frame, adapters, ...) comes in as an `Accepts`, from the loaded pipeline in a
replica or from what the live replicas publish in a producer.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Mapping

from .errors import InvalidRequest
from .keys import REQUEST_ID_RE
from .limits import MAX_FPS, MAX_FRAMES, MAX_GUIDANCE, MAX_SEED, MAX_SEQUENCE_LENGTH, MAX_SIDE, MAX_STEPS
from .models import check_model_name
from .recipe import Recipe
from .scheduling import check_priority, check_tenant, check_user
from .webhook import Webhook, check_webhook


class Quality(StrEnum):
    """A request's choice of path: part of its input's identity."""

    STANDARD = "standard"  # the exact path: every block of the transformer at every step
    FAST = "fast"  # the deployment's step cache (REPLICADP_CACHE), where it has one


# A request's `loras` names adapters a deployment registered (model/adapters.py): the names, how many a request may
# run with, and their scales, as the registry and requests both check them.
LORA_NAME_RE = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")
MAX_LORAS = 4  # per request: each active adapter costs two small matmuls per adapted layer and pass
MAX_SCALE = 4.0  # |scale|: past a few, a LoRA trained at 1 gives noise, not a style


def is_scale(value) -> bool:
    """An adapter's scale: a number (not a bool) of at most MAX_SCALE either way."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and abs(value) <= MAX_SCALE

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
    "quality": Quality.STANDARD,  # the exact path; "fast" runs the deployment's step cache (model/step_cache.py)
    # Two-expert models only (Wan2.2 A14B): the low-noise expert's guidance (None: guidance_scale), and where the
    # experts switch, as a share of the training timesteps (None: the model's own boundary_ratio).
    "guidance_scale_2": None,
    "boundary_ratio": None,
    # The deployment's registered LoRA adapters this request runs with, and their scales (model/adapters.py):
    # [{"name": ..., "scale": ...}, ...]; none by default.
    "loras": None,
}
# Unset, these are left out of a request's params (and so of its identity): requests made before they existed, or
# to one-expert models, or without adapters, keep their identity.
TWO_EXPERT_FIELDS = ("guidance_scale_2", "boundary_ratio")
OPTIONAL_FIELDS = (*TWO_EXPERT_FIELDS, "loras")
# Where the request waits, not what it makes (scheduling.py): checked here, never part of its identity.
SCHEDULING_FIELDS = ("priority", "tenant", "user")
# How the request is told of its events (webhook.py), not what it makes: checked here, never part of its identity.
WEBHOOK_FIELDS = ("webhook", "webhook_events")
# Which model runs it (models.py): its queue, not its identity (a replica's identity names its checkpoint).
ROUTING_FIELDS = ("model",)
NOT_INPUTS = (*SCHEDULING_FIELDS, *WEBHOOK_FIELDS, *ROUTING_FIELDS)
FIELDS = ("prompt", *DEFAULTS, *SCHEDULING_FIELDS, *WEBHOOK_FIELDS, *ROUTING_FIELDS)
REFERENCE_SIZE = f"{DEFAULTS['width']}x{DEFAULTS['height']}"
REFERENCE_WORK = DEFAULTS["height"] * DEFAULTS["width"] * DEFAULTS["num_frames"] * DEFAULTS["num_inference_steps"]



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
    # Where its events go: how it is told, not what it makes (no part of its identity, nor of equality).
    webhook: Webhook | None = field(default=None, compare=False)

    def params(self, image_sha256: str | None = None) -> dict:
        """The effective inputs as reported back: the image by its hash, not its (possibly huge) bytes; the
        two-expert fields only where set."""
        p = asdict(self)
        del p["request_id"], p["image"], p["webhook"]
        p["loras"] = [{"name": name, "scale": scale} for name, scale in self.loras] or None
        for name in OPTIONAL_FIELDS:
            if p[name] is None:
                del p[name]
        p["image_sha256"] = image_sha256
        return p


@dataclass(frozen=True)
class Tokens:
    """How a model cuts a video into transformer tokens: its VAE's strides (frames, pixels) and its patch."""

    vae_temporal: int
    vae_spatial: int
    patch: tuple[int, int, int]  # (frames, height, width) of latents per token

    def count(self, height: int, width: int, num_frames: int) -> int:
        """The video tokens of one transformer pass on this shape: latent frames x latent patches."""
        pt, ph, pw = self.patch
        latent_frames = (num_frames - 1) // self.vae_temporal + 1
        return (latent_frames // pt) * (height // self.vae_spatial // ph) * (width // self.vae_spatial // pw)


@dataclass(frozen=True)
class Accepts:
    """What a model accepts, as validate_request checks a request against it: a loaded pipeline's rules
    (PipelineHolder.accepts), or what the live replicas publish (ReplicaInfo). Left at their defaults, the checks
    that need the model are left to the replica, which checks again."""

    size_multiple: int = 16  # height and width are multiples of it: the VAE's downsampling times the patch size
    qualities: tuple[str, ...] | None = None  # the paths it serves (None: unknown)
    experts: int | None = None  # its transformers: 1 refuses guidance_scale_2 and boundary_ratio (None: unknown)
    takes_image: bool | None = None  # whether a first frame may be given (None: unknown)
    requires_image: bool = False  # an image-to-video model: a request without a first frame is refused
    defaults: Mapping[str, object] = field(default_factory=dict)  # the model's own over DEFAULTS (its guidance)
    loras: Mapping[str, float] | None = None  # its registered adapters, name -> default scale (None: unknown)
    # A replica over several sequence ranks (REPLICADP_PARALLEL, its `parallel`) splits every request's video
    # tokens evenly over them: a shape whose token count they do not divide is refused.
    sequence_ranks: int = 1
    parallel: str = "none"
    tokens: Tokens | None = None
    # Few-step sampling (recipe.py): the model's own recipe, and the registered adapters' that bring one.
    recipe: Recipe | None = None
    lora_recipes: Mapping[str, Recipe] = field(default_factory=dict)

    def recipe_for(self, loras: tuple[tuple[str, float | None], ...]) -> tuple[Recipe, str] | None:
        """The recipe a request with these adapters samples with, and whose it is (for messages): the model's, or
        that of the one adapter named that brings one; None for neither. InvalidRequest naming `loras` where two
        would apply."""
        recipes = [(f"adapter {name!r}", self.lora_recipes[name]) for name, _ in loras if name in self.lora_recipes]
        recipes = ([("this model", self.recipe)] if self.recipe is not None else []) + recipes
        if len(recipes) > 1:
            _fail("loras", [name for name, _ in loras], f"{recipes[0][0]} and {recipes[1][0]} each bring a sampling "
                  "recipe of their own; a request runs with one")
        return (recipes[0][1], recipes[0][0]) if recipes else None



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
    return float(value) + 0.0  # -0.0 is 0.0: one number, one identity (input_key's JSON would tell them apart)


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


# A JSON value a request carries in a text field (the gateway's `loras`) is decoded only within these bounds: the
# decoder recurses once per nested list or object, and a deep enough one exhausts it (RecursionError).
MAX_JSON_DEPTH = 8
MAX_JSON_NUMBER_CHARS = 32  # a number longer than this is no scale or count: refused before converting it


def decode_json(field: str, text: str, max_chars: int | None) -> object:
    """`text`, the JSON a request carries in `field`, decoded within bounds: at most `max_chars` characters (None:
    any), MAX_JSON_DEPTH nested lists or objects, no key given twice in an object (which would silently keep the
    last), no NaN or infinite number, no number of more than MAX_JSON_NUMBER_CHARS characters. InvalidRequest
    naming the field otherwise, never another error."""
    if not isinstance(text, str):
        _fail(field, text, f"must be JSON text, got {type(text).__name__}")
    if max_chars is not None and len(text) > max_chars:
        _fail(field, text, f"is {len(text)} characters long; the limit is {max_chars}")

    def pairs(items: list) -> dict:
        twice = repeated_key(items)
        if twice is not None:
            raise ValueError(f"key {twice!r} given twice")
        return dict(items)

    def number(kind):
        def parse(digits: str):
            if len(digits) > MAX_JSON_NUMBER_CHARS:
                raise ValueError(f"a number of {len(digits)} characters")
            value = kind(digits)
            if not math.isfinite(value):
                raise ValueError(f"{digits} is not a finite number")
            return value
        return parse

    def constant(name: str):
        raise ValueError(f"{name} is not a number JSON allows")

    try:
        value = json.loads(text, object_pairs_hook=pairs, parse_int=number(int), parse_float=number(float),
                           parse_constant=constant)
    except RecursionError:
        _fail(field, text, f"nests lists or objects deeper than {MAX_JSON_DEPTH}")
    except ValueError as exc:  # json's own errors are ValueErrors too
        _fail(field, text, f"is not JSON within bounds: {exc}")
    if json_depth(value) > MAX_JSON_DEPTH:
        _fail(field, text, f"nests lists or objects deeper than {MAX_JSON_DEPTH}")
    return value


def repeated_key(items: list[tuple]) -> str | None:
    """The first key given twice among a JSON object's (key, value) pairs (json's object_pairs_hook), or None."""
    seen = set()
    for key, _ in items:
        if key in seen:
            return key
        seen.add(key)
    return None


def json_depth(value) -> int:
    """How deep `value`'s lists and objects nest (0 for a scalar), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in children)
    return deepest


def check_loras(value, registered: dict[str, float] | None = None) -> tuple[tuple[str, float | None], ...]:
    """A request's `loras`: a list of at most MAX_LORAS {"name", "scale"} objects, names of registered adapters
    (`registered`: name -> default scale; None: unknown here, the replica checks), each once, |scale| at most
    MAX_SCALE (left out: the adapter's default). Returns (name, scale) pairs sorted by name: the order they are
    applied in and part of the identity. InvalidRequest naming `loras` otherwise."""
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_LORAS:
        _fail("loras", value, f"must be a list of at most {MAX_LORAS} objects {{\"name\": ..., \"scale\": ...}}")
    pairs = {}
    for entry in value:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or set(entry) - {"name", "scale"}:
            _fail("loras", value, 'each entry must be an object {"name": ..., "scale": ...} (scale optional)')
        name, scale = entry["name"], entry.get("scale")
        if not LORA_NAME_RE.fullmatch(name) or (registered is not None and name not in registered):
            known = "none" if not registered else ", ".join(sorted(registered))
            _fail("loras", name, f"no such adapter here; registered: {known}" if registered is not None else
                  "is not an adapter's name (1-64 of a-z, 0-9, '_', '.', '-')")
        if name in pairs:
            _fail("loras", name, "is named twice")
        if scale is not None and not is_scale(scale):
            _fail("loras", scale, f"a scale must be a number from -{MAX_SCALE:g} to {MAX_SCALE:g}")
        if scale is None and registered is not None:
            scale = registered[name]
        pairs[name] = None if scale is None else float(scale) + 0.0  # -0.0 is 0.0, as _float says
    return tuple(sorted(pairs.items()))


def validate_request(kwargs: dict, accepts: Accepts = Accepts(), *, max_prompt_chars: int = 4000,
                     max_work: int | None = None) -> GenerateRequest:
    """Check `generate`'s keyword arguments against what the model `accepts` and return them with defaults filled
    in (the model's own first, then DEFAULTS), the webhook's form checked (what a deployment allows a webhook is
    webhooks.check_allowed's). `max_prompt_chars` and `max_work` (height x width x num_frames x
    num_inference_steps) are the deployment's limits. Raises InvalidRequest naming the first bad field.
    """
    unknown = sorted(set(kwargs) - set(FIELDS))
    if unknown:
        _fail(unknown[0], kwargs[unknown[0]], f"unknown argument; accepted: {', '.join(FIELDS)}")
    if "prompt" not in kwargs or kwargs["prompt"] is None:
        _fail("prompt", None, "is required")
    check_priority(kwargs.get("priority"))
    check_tenant(kwargs.get("tenant"))
    check_user(kwargs.get("user"))
    if kwargs.get("model") is not None:
        check_model_name(kwargs["model"])
    loras = check_loras(kwargs.get("loras"), accepts.loras)
    given = {k: x for k, x in kwargs.items() if x is not None and k not in NOT_INPUTS}
    # A few-step model's (or adapter's) recipe: its steps and guidance by default, refusing what it cannot do.
    recipe = accepts.recipe_for(loras)
    if recipe is not None:
        recipe[0].check(given, recipe[1])
    # A two-expert model's own defaults name guidance_scale_2: the recipe's replaces it.
    experts = 2 if "guidance_scale_2" in accepts.defaults else 1
    v = {**DEFAULTS, **accepts.defaults, **(recipe[0].defaults(experts) if recipe else {}), **given}

    for side in ("height", "width"):
        _int(side, v[side], accepts.size_multiple, MAX_SIDE)
        if v[side] % accepts.size_multiple:
            _fail(side, v[side], f"must be a multiple of {accepts.size_multiple} for this model")
    _int("num_frames", v["num_frames"], 1, MAX_FRAMES)
    if (v["num_frames"] - 1) % 4:
        _fail("num_frames", v["num_frames"], "must be of the form 4k+1 (1, 5, 9, ..., 33, ...)")
    if v["quality"] not in list(Quality):
        _fail("quality", v["quality"], f"must be one of {', '.join(Quality)}")
    if accepts.qualities is not None and v["quality"] not in accepts.qualities:
        _fail("quality", v["quality"], f"not served here: these replicas serve {', '.join(accepts.qualities)} only "
                                       "(their deployment has no step cache: REPLICADP_CACHE=none)")
    request_id = v["request_id"]
    if request_id is not None and (not isinstance(request_id, str) or not REQUEST_ID_RE.fullmatch(request_id)):
        _fail("request_id", request_id, "must be 1-128 characters of letters, digits, '_', '.', '-', starting with a letter or digit")
    for name in TWO_EXPERT_FIELDS:
        if v[name] is not None and accepts.experts == 1:
            _fail(name, v[name], "this model has one expert: only two-expert models (Wan2.2 A14B) take it")
    image = v["image"]
    if image is not None and (not isinstance(image, str) or not image):
        _fail("image", image, "must be a non-empty string (a path, an http(s) URL or base64)")
    if image is None and accepts.requires_image:
        raise InvalidRequest.of("image", "this model is image-to-video and needs a first frame")
    if image is not None and accepts.takes_image is False:
        _fail("image", image[:40], "this model is text-to-video only and takes no first frame")

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
        loras=loras,
        webhook=check_webhook(kwargs.get("webhook"), kwargs.get("webhook_events"), kwargs.get("tenant")),
    )
    work = req.height * req.width * req.num_frames * req.num_inference_steps
    if max_work is not None and work > max_work:
        _fail("height x width x num_frames x num_inference_steps",
              f"{req.height}x{req.width}x{req.num_frames}x{req.num_inference_steps}",
              f"= {work} is over this deployment's budget REPLICADP_MAX_WORK={max_work}")
    refused = accepts.tokens and split_refusal(accepts.tokens.count(req.height, req.width, req.num_frames),
                                               accepts.sequence_ranks)
    if refused:
        _fail("height x width x num_frames", f"{req.height}x{req.width}x{req.num_frames}",
              f"{refused} (REPLICADP_PARALLEL={accepts.parallel}); choose a size or frame count whose token count "
              "they divide")
    return req


def split_refusal(tokens: int, sequence_ranks: int) -> str | None:
    """Why a replica whose layout splits each pass's video tokens over `sequence_ranks` ranks cannot run a shape of
    `tokens` tokens (they must split evenly), or None."""
    if tokens % sequence_ranks:
        return f"its {tokens} video tokens do not split over the replica's {sequence_ranks} sequence ranks"
    return None
