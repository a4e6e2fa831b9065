"""The devices a replica runs on (its GPUs, or the CPU): how they are named in results, the memory each has for
the weights, their clocks and peaks, and what a failed call tells of their memory. torch is imported inside the
functions (a Celery main process imports this and must not initialise CUDA)."""

from __future__ import annotations

import ctypes
import gc
import os
import resource

from .memory import Devices


def describe_device(device: str) -> str:
    """A device as results name it: `cuda` with the GPUs the replica sees (CUDA_VISIBLE_DEVICES), else as it is."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return f"{device} (CUDA_VISIBLE_DEVICES={visible})" if device.startswith("cuda") and visible else device


def device_memory(device: str, devices: list[str], memory_gib: float | None) -> Devices:
    """`devices` with the memory each has for the weights: a GPU's free memory at load, or `memory_gib`
    (REPLICADP_DEVICE_MEMORY_GIB) where that is lower (the allocator is then held to it); a CPU's: the setting alone
    (None: not checked). Group offload streams blocks ahead on CUDA."""
    import torch

    cap = None if memory_gib is None else int(memory_gib * 2**30)
    setting = f"REPLICADP_DEVICE_MEMORY_GIB={memory_gib:g}" if cap is not None else None
    if device != "cuda":
        return Devices(devices, [cap], setting or "not checked")
    free = [torch.cuda.mem_get_info(d)[0] for d in devices]
    if cap is None or cap >= min(free):
        return Devices(devices, free, "free at load", streamed=True)
    for d in devices:
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / torch.cuda.mem_get_info(d)[1]), d)
    return Devices(devices, [cap] * len(devices), setting, streamed=True)


def synchronize(device: str, devices: list[str]) -> None:
    """Wait for the GPUs' queued work (nothing to wait for on the CPU)."""
    import torch

    if device == "cuda":
        for d in devices:
            torch.cuda.synchronize(d)


def reset_peak_memory(device: str, devices: list[str]) -> None:
    import torch

    if device == "cuda":
        for d in devices:
            torch.cuda.reset_peak_memory_stats(d)


def peak_memory_gib(device: str, devices: list[str]) -> float:
    """The most the allocator held since reset_peak_memory, on all `devices` together; on the CPU, the process's
    largest resident set."""
    import torch

    if device == "cuda":
        held = sum(torch.cuda.max_memory_reserved(d) for d in devices)
    else:
        held = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return round(held / 2**30, 3)


def free_memory() -> None:
    """Give back what the last request left: Python garbage, then the CUDA caching allocator's blocks, or on the
    CPU the heap that glibc keeps after large frees."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    else:
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass


def is_out_of_memory(exc: BaseException) -> bool:
    """CUDA's OutOfMemoryError, or the CPU allocator's failure (a RuntimeError), or Python's MemoryError."""
    import torch

    text = str(exc).lower()
    return isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or isinstance(exc, RuntimeError) and (
        "out of memory" in text or "can't allocate memory" in text)
