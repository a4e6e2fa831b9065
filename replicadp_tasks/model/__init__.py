"""The model: everything that holds or runs torch and diffusers, and nothing else (no Celery, no Redis, no
settings: a replica's choices come in as ModelOptions). The pipeline holder (pipeline.py) and where its model
comes from (loading.py), the architectures it can build and their FLOPs (architectures.py, tiny_model.py), what
a deployment may choose about it (options.py) and cannot combine (compatibility.py): adapters, step caches,
quantization, memory options, layouts over several processes (adapters.py, step_cache.py, quantization.py,
memory.py, layout.py, parallel.py, follower.py), reproducible numerics (determinism.py), the hub (hub.py), and the
synthetic backend for benchmarks (synthetic.py). torch is imported when a model loads, never at import."""

from . import architectures, memory
from .adapters import read_registry
from .architectures import GPU_MEMORY_GIB, PEAK_TFLOPS
from .compatibility import conflicts
from .devices import describe_device
from .layout import Layout
from .loading import RANDOM_PREFIX, SYNTHETIC_PREFIX, TINY_SPECS, resolve_model
from .memory import Offload
from .options import ModelOptions
from .pipeline import PipelineHolder
from .quantization import Quantize
from .step_cache import CacheMethod, StepCache, calibrate_mag, mag_ratios_file
from .synthetic import SyntheticBackend
from .tiny_model import TURBO_RECIPE, ensure_tiny_model, save_tiny_lora, save_tiny_turbo


def open_pipeline(options: ModelOptions, **place) -> PipelineHolder | SyntheticBackend:
    """The pipeline `options` name, not loaded yet: the benchmark-only synthetic backend for synthetic:..., else a
    PipelineHolder (`place`: this process's rank in a layout over several, PipelineHolder's keywords)."""
    if options.spec.startswith(SYNTHETIC_PREFIX):
        return SyntheticBackend(options)
    return PipelineHolder(options, **place)


__all__ = ["GPU_MEMORY_GIB", "PEAK_TFLOPS", "RANDOM_PREFIX", "TINY_SPECS", "CacheMethod", "Layout", "ModelOptions",
           "Offload", "PipelineHolder", "Quantize", "StepCache", "SyntheticBackend", "architectures", "calibrate_mag",
           "conflicts", "describe_device", "ensure_tiny_model", "mag_ratios_file", "memory", "open_pipeline",
           "read_registry", "resolve_model", "save_tiny_lora", "save_tiny_turbo", "TURBO_RECIPE"]
