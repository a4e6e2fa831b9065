"""What a deployment cannot combine, in one table: a replica refuses such options at load, naming both settings,
before anything is loaded, and `replicadp describe-model` says the same of the options it is given."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..contract.errors import ModelLoadError
from . import adapters
from .memory import Offload
from .options import COMPILE_MODES, ModelOptions
from .quantization import Quantize
from .step_cache import CacheMethod

NOT_YET = "not supported yet"


def chosen(options: ModelOptions) -> dict[str, str | None]:
    """The settings the table names that `options` set away from their defaults, each with its value as a message
    shows it (None: named alone, as an adapter registry, whose path says nothing here)."""
    values = {"REPLICADP_CACHE": (options.cache.method, CacheMethod.NONE),
              "REPLICADP_COMPILE": (options.compile, "none"),
              "REPLICADP_QUANTIZE": (options.quantize, Quantize.NONE),
              "REPLICADP_OFFLOAD": (options.offload, Offload.NONE),
              "REPLICADP_PARALLEL": (str(options.layout), "none")}
    set_ = {name: str(value) for name, (value, default) in values.items() if value != default}
    # Adapters fused at load are the model's weights: only those switched per request take part.
    return set_ | ({"REPLICADP_LORAS": None} if adapters.switched(options.loras_file) else {})


@dataclass(frozen=True)
class Conflict:
    """Two settings a replica refuses together (`when`: only in these cases of both being set)."""

    first: str
    second: str
    why: str
    when: Callable[[ModelOptions], bool] = lambda options: True


CONFLICTS = (
    # diffusers' cache hooks are torch.compiler.disable'd functions inside the blocks that compile traces whole
    # (fullgraph): every fast request would fail (tried on the tiny model, each method).
    Conflict("REPLICADP_CACHE", "REPLICADP_COMPILE", "the cache's hooks cannot be compiled"),
    # Adapters switched per request (not fused at load) have not run with these: compile would trace them in or out,
    # FP8 and offloading move the layers peft wraps, followers would need the same switching.
    Conflict("REPLICADP_LORAS", "REPLICADP_COMPILE", NOT_YET),
    Conflict("REPLICADP_LORAS", "REPLICADP_QUANTIZE", NOT_YET),
    Conflict("REPLICADP_LORAS", "REPLICADP_OFFLOAD", NOT_YET),
    Conflict("REPLICADP_LORAS", "REPLICADP_PARALLEL", NOT_YET),
    # Neither has run on offloaded weights: torchao quantizes, and compile traces, modules in place.
    Conflict("REPLICADP_OFFLOAD", "REPLICADP_QUANTIZE", NOT_YET),
    Conflict("REPLICADP_OFFLOAD", "REPLICADP_COMPILE", NOT_YET),
    # None has run on a transformer split over ranks.
    Conflict("REPLICADP_PARALLEL", "REPLICADP_OFFLOAD", NOT_YET),
    Conflict("REPLICADP_PARALLEL", "REPLICADP_COMPILE", NOT_YET),
    Conflict("REPLICADP_PARALLEL", "REPLICADP_QUANTIZE", NOT_YET),
    # FirstBlock and Mag decide what to skip from the transformer's output, of which each sequence rank holds its
    # own slice: the ranks may disagree. Every cache keeps its state per pass ("cond", "uncond"), and a cfg rank 1
    # runs the unconditional pass in the conditional one's context.
    Conflict("REPLICADP_PARALLEL", "REPLICADP_CACHE", "its ranks would not skip the same work",
             when=lambda o: o.cache.method in (CacheMethod.FIRST_BLOCK, CacheMethod.MAG) or o.layout.cfg > 1),
)


def conflicts(options: ModelOptions) -> list[str]:
    """Why a replica would refuse `options`, one line per pair of settings it cannot combine (none: it would not)."""
    values = chosen(options)

    def named(setting: str) -> str:
        return setting if values[setting] is None else f"{setting}={values[setting]}"

    return [f"{named(c.first)} cannot be combined with {named(c.second)}: {c.why}; choose one of them"
            for c in CONFLICTS if c.first in values and c.second in values and c.when(options)]


def check(options: ModelOptions) -> None:
    """ModelLoadError naming the setting, for a compile mode that does not exist or the first pair of settings the
    table refuses."""
    if options.compile not in COMPILE_MODES:
        raise ModelLoadError(f"REPLICADP_COMPILE={options.compile!r}: expected one of {', '.join(COMPILE_MODES)}")
    refused = conflicts(options)
    if refused:
        raise ModelLoadError(refused[0])


def check_experts(options: ModelOptions, experts: int) -> None:
    """ModelLoadError for a step cache that cannot serve a model of `experts` transformers: MagCache's ratios are
    calibrated on one transformer's residuals at every step (calibrate-mag), and each of two experts runs only
    some of the steps."""
    method = options.cache.method
    if method == CacheMethod.MAG and experts > 1:
        others = ", ".join(m for m in CacheMethod if m not in (CacheMethod.NONE, CacheMethod.MAG))
        raise ModelLoadError(f"REPLICADP_CACHE={method}: MagCache's ratios are calibrated on one transformer, and "
                             f"{options.spec!r} has two experts; choose one of {others}")
