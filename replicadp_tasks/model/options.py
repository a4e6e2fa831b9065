"""What a deployment chooses about its model (REPLICADP_MODEL and the settings that load and run it), as a replica's
pipeline holder takes it: settings.Settings.model_options builds it once at start; a multi-process replica's rank 0
hands its followers the same (as JSON), so that every rank loads the same model the same way."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from .layout import Layout
from .memory import Offload
from .quantization import Quantize
from .step_cache import CacheMethod, StepCache

COMPILE_MODES = ("none", "blocks", "full")


@dataclass(frozen=True)
class ModelOptions:
    """The served model and how it is loaded and run. The defaults are settings.py's (each setting's reason is
    told there)."""

    spec: str  # REPLICADP_MODEL: a hub id, a folder, tiny..., random:ARCH or synthetic:SECONDS (loading.py)
    model_cache: Path  # REPLICADP_MODEL_CACHE: where `tiny` models are built, MagCache's ratios written
    threads: int = 1  # REPLICADP_THREADS: a CPU replica's torch threads
    vae_tiling: bool = False  # REPLICADP_VAE_TILING
    attention: str = "native"  # REPLICADP_ATTENTION: diffusers' attention backend
    compile: str = "none"  # REPLICADP_COMPILE: one of COMPILE_MODES
    deterministic: bool = True  # REPLICADP_DETERMINISTIC (determinism.py)
    cache: StepCache = field(default_factory=lambda: StepCache(CacheMethod.NONE))  # the fast path's step cache
    quantize: Quantize = Quantize.NONE  # REPLICADP_QUANTIZE
    offload: Offload = Offload.NONE  # REPLICADP_OFFLOAD
    memory_gib: float | None = None  # REPLICADP_DEVICE_MEMORY_GIB
    layout: Layout = Layout()  # REPLICADP_PARALLEL
    parallel_timeout_s: float = 60.0  # REPLICADP_PARALLEL_TIMEOUT
    load_timeout_s: float = 900.0  # REPLICADP_LOAD_TIMEOUT: also how long the ranks wait for each other to start
    loras_file: str | None = None  # REPLICADP_LORAS: the registered adapters (adapters.py)
    recipe: str | None = None  # REPLICADP_RECIPE: the model's sampling recipe, a TOML inline table (contract/recipe.py)

    def to_json(self) -> str:
        return json.dumps({**asdict(replace(self, model_cache=str(self.model_cache)))})

    @classmethod
    def from_json(cls, text: str) -> "ModelOptions":
        fields = json.loads(text)
        cache = fields["cache"]
        return cls(**{**fields, "model_cache": Path(fields["model_cache"]), "quantize": Quantize(fields["quantize"]),
                      "offload": Offload(fields["offload"]), "layout": Layout(**fields["layout"]),
                      "cache": StepCache(CacheMethod(cache["method"]), cache["threshold"], cache["interval"],
                                         None if cache["mag_ratios"] is None else tuple(cache["mag_ratios"]))})
