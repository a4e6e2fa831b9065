"""Memory options (REPLICADP_OFFLOAD): where a replica keeps the models it is not running, chosen by the deployment,
and the check at load that the chosen option fits the replica's devices.

A Wan2.2 A14B replica holds two 14B experts (26.6 GiB each in bf16) and UMT5-xxl (10.6 GiB): 64 GiB of weights,
more than an 80 GB GPU leaves once a 720p request's activations are counted. Each option below trades time (the
weights cross PCIe while a request waits) for GPU memory. None changes a request's output: the same weights do
the same arithmetic wherever they were kept between calls, so no option enters an input's identity.

Imports no Celery; torch and diffusers are imported inside the functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from ..contract.errors import ModelLoadError

MODELS = ("text_encoder", "image_encoder", "transformer", "transformer_2", "vae")


class Offload(StrEnum):
    """REPLICADP_OFFLOAD."""

    NONE = "none"  # every model resident on the replica's GPU(s): the fastest; the default
    EXPERT = "expert"  # two experts: the idle one in CPU memory, moved in when the pipeline switches to it
    MODEL = "model"  # diffusers' model offload: each model moved to the GPU when it runs, the one before moved out
    GROUP = "group"  # diffusers' group offload: each transformer block moved in when it runs (streamed on CUDA)


@dataclass(frozen=True)
class Need:
    """What an option needs on one device: the weights it holds there at most, by model."""

    device: str
    parts: dict[str, int]  # model name -> bytes held at the peak

    @property
    def total(self) -> int:
        return sum(self.parts.values())


def models_of(pipe) -> dict:
    """The pipeline's models (torch modules) by component name, in MODELS' order."""
    return {name: getattr(pipe, name) for name in MODELS if getattr(pipe, name, None) is not None}


def weight_bytes(module) -> int:
    """Bytes of a module's parameters and buffers in their current dtypes (meta tensors count too)."""
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def block_bytes(module) -> tuple[int, int]:
    """(bytes outside the module's top-level blocks, bytes of its largest block): group offload's unit. The blocks
    are what diffusers' block-level group offload moves one at a time: the items of a ModuleList or Sequential
    among the module's children. A model that names its own block modules (the VAE) counts as one block."""
    import torch

    if getattr(module, "_group_offload_block_modules", None):
        return 0, weight_bytes(module)
    blocks = [b for child in module.children() if isinstance(child, (torch.nn.ModuleList, torch.nn.Sequential))
              for b in child]
    inside = sum(weight_bytes(b) for b in blocks)
    return weight_bytes(module) - inside, max((weight_bytes(b) for b in blocks), default=0)


@dataclass(frozen=True)
class Devices:
    """A replica's devices as the memory check sees them: their names, the memory each has for the weights (None:
    unknown, not checked), where that figure comes from (for the error), and whether group offload streams blocks
    ahead on them (CUDA: the next block is prefetched while one runs)."""

    names: list[str]
    have: list[int | None]
    limit: str = "not checked"
    streamed: bool = False


def placement(components, gpus: int) -> dict[str, int]:
    """Which of `gpus` devices (by index) holds each of `components` (names) while all are resident: on one, all
    on it; across several, the transformer and `transformer_2` (both experts) on the second, the text encoder on
    the first, the VAE on the third if there is one, else on the first. place() and describe-model use it."""
    if gpus == 1:
        return {name: 0 for name in components}
    where = {"text_encoder": 0, "transformer": 1, "transformer_2": 1, "vae": 2 if gpus > 2 else 0}
    return {name: where[name] for name in components}


def place(pipe, devices: list[str]) -> None:
    """Put the pipeline's models on `devices` (see placement); across several GPUs (GPUS_PER_REPLICA),
    accelerate's hooks move each model's inputs to its device and its outputs back, so the pipeline's own code
    runs unchanged (its tensors live on the first hooked model's device)."""
    if len(devices) == 1:
        pipe.to(devices[0])
        return
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    models = [name for name in ("text_encoder", "transformer", "transformer_2", "vae")
              if getattr(pipe, name, None) is not None]
    for name, index in placement(models, len(devices)).items():
        module = getattr(pipe, name).to(devices[index])
        add_hook_to_module(module, AlignDevicesHook(execution_device=devices[index], io_same_device=True))


def needs(models: dict, offload: Offload, devices: Devices) -> list[Need]:
    """The weights `offload` keeps on each of `devices` at most."""
    sizes = {name: weight_bytes(m) for name, m in models.items()}
    if offload == Offload.NONE:
        where = placement(list(models), len(devices.names))
        return [Need(d, {n: b for n, b in sizes.items() if where[n] == i}) for i, d in enumerate(devices.names)]
    first = devices.names[0]
    if offload == Offload.EXPERT:
        # The larger expert counts (they are the same size in every Wan2.2 A14B): `transformer` is resident first.
        idle = "transformer_2" if sizes["transformer_2"] <= sizes["transformer"] else "transformer"
        return [Need(first, {n: b for n, b in sizes.items() if n != idle})]
    if offload == Offload.MODEL:
        largest = max(sizes, key=sizes.get)  # one model on the GPU at a time
        return [Need(first, {largest: sizes[largest]})]
    per_model = {}
    for name, m in models.items():
        outside, block = block_bytes(m)
        per_model[name] = outside + block * (2 if devices.streamed and outside else 1)
    largest = max(per_model, key=per_model.get)
    return [Need(first, {largest: per_model[largest]})]


def usable(offload: Offload, models: dict, devices: list[str]) -> str | None:
    """Why `offload` cannot serve these models on these devices (names), or None."""
    if offload == Offload.EXPERT and "transformer_2" not in models:
        return ("the model has one transformer; the option keeps the idle one of two experts (Wan2.2 A14B) in CPU "
                f"memory. Choices: {', '.join(Offload)}")
    if offload != Offload.NONE and len(devices) > 1:
        return (f"offloading serves a replica of one GPU; this one has {len(devices)} (GPUS_PER_REPLICA). Choose "
                "REPLICADP_OFFLOAD=none or one GPU per replica")
    return None


def shortfall(models: dict, offload: Offload, devices: Devices) -> tuple[Need, int] | None:
    """The first device where `offload` needs more than it has (unknown: not checked), with what it has; None where
    the option fits."""
    for need, held in zip(needs(models, offload, devices), devices.have):
        if held is not None and need.total > held:
            return need, held
    return None


def check(models: dict, offload: Offload, devices: Devices) -> None:
    """Raise ModelLoadError, naming the setting, the need and what the device has, if `offload` does not fit on
    `devices`. The error lists the options that would fit. Weights only: a request's activations come on top (its
    peak_memory_gib)."""
    why = usable(offload, models, devices.names)
    if why is not None:
        raise ModelLoadError(f"REPLICADP_OFFLOAD={offload}: {why}")
    short = shortfall(models, offload, devices)
    if short is None:
        return
    need, held = short
    parts = " + ".join(f"{name} {size(b)}" for name, b in need.parts.items())
    fitting = [f"REPLICADP_OFFLOAD={o} needs {size(max(n.total for n in needs(models, o, devices)))}"
               for o in Offload if o != offload and usable(o, models, devices.names) is None
               and shortfall(models, o, devices) is None]
    hint = f"; {', '.join(fitting)}" if fitting else "; no memory option fits: use a larger GPU"
    raise ModelLoadError(f"REPLICADP_OFFLOAD={offload}: the weights need {size(need.total)} on {need.device} ({parts}), "
                         f"and {need.device} has {size(held)} ({devices.limit}){hint}")


def size(n: int) -> str:
    """Bytes as GiB, or MiB below a tenth of one (the tiny models weigh kilobytes)."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 / 10 else f"{n / 2**20:.2f} MiB"


def apply(pipe, offload: Offload, device: str) -> None:
    """Set the option up on a pipeline whose models are in CPU memory, for a replica of one `device`."""
    import torch

    pipe.to("cpu")  # random:ARCH is built on the GPU where it fits whole
    if offload == Offload.MODEL:
        pipe.enable_model_cpu_offload(device=device)
    elif offload == Offload.GROUP:
        pipe.enable_group_offload(onload_device=torch.device(device), offload_device=torch.device("cpu"),
                                  offload_type="block_level", num_blocks_per_group=1,
                                  use_stream=device.startswith("cuda"))
    else:
        keep_one_expert(pipe, device)


def keep_one_expert(pipe, device: str) -> None:
    """Everything on `device` but one expert: the expert about to run is moved in by a forward pre-hook, the other
    one out first. A request switches once at its boundary, and once more at its start when the last request
    ended on `transformer_2`."""
    resident = {"expert": pipe.transformer}
    pipe.transformer_2.to("cpu")
    for name, model in models_of(pipe).items():
        if name != "transformer_2":
            model.to(device)

    def moves_in(expert, other):
        def pre_hook(_module, _args):
            if resident["expert"] is not expert:
                other.to("cpu")
                expert.to(device)
                resident["expert"] = expert
        return pre_hook

    pipe.transformer.register_forward_pre_hook(moves_in(pipe.transformer, pipe.transformer_2))
    pipe.transformer_2.register_forward_pre_hook(moves_in(pipe.transformer_2, pipe.transformer))
