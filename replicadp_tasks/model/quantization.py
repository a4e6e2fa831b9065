"""Weight and activation quantization of the transformer (REPLICADP_QUANTIZE), applied once at load: it changes
every request's output, so it is a deployment's choice (and part of every input's identity), not a request's.

Imports no Celery; torch and torchao are imported inside `quantize`.
"""

from __future__ import annotations

from enum import StrEnum

from ..contract.errors import ModelLoadError

FP8_CAPABILITY = (8, 9)  # Ada, Hopper and later: the first GPUs with FP8 tensor cores


class Quantize(StrEnum):
    """REPLICADP_QUANTIZE."""

    NONE = "none"  # the checkpoint's weights in bf16 (fp32 on a CPU)
    FP8 = "fp8"  # torchao's FP8 weights and dynamically scaled FP8 activations in the transformer's linear layers


def quantize(pipe, mode: Quantize, device: str, devices: list[str]) -> None:
    """Quantize `pipe`'s transformer in place, or raise ModelLoadError saying why this replica cannot."""
    if mode == Quantize.NONE:
        return
    import torch

    if device != "cuda":
        raise ModelLoadError(f"REPLICADP_QUANTIZE={mode}: needs a CUDA GPU of compute capability "
                             f"{'.'.join(map(str, FP8_CAPABILITY))} or newer (Ada, Hopper, Blackwell); this replica "
                             f"runs on {device}. Choices: {', '.join(Quantize)}")
    for d in devices:
        capability = torch.cuda.get_device_capability(d)
        if capability < FP8_CAPABILITY:
            raise ModelLoadError(f"REPLICADP_QUANTIZE={mode}: {torch.cuda.get_device_name(d)} ({d}) has compute "
                                 f"capability {capability[0]}.{capability[1]}; FP8 needs "
                                 f"{'.'.join(map(str, FP8_CAPABILITY))} or newer")
    try:
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, quantize_
    except ImportError as exc:
        raise ModelLoadError(f"REPLICADP_QUANTIZE={mode}: needs torchao (pip install 'replicadp[fp8]'): {exc}") from None
    for expert in (pipe.transformer, getattr(pipe, "transformer_2", None)):  # both of Wan2.2 A14B's experts
        if expert is not None:
            quantize_(expert, Float8DynamicActivationFloat8WeightConfig())
