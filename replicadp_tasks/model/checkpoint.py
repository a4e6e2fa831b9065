"""A request stopped at a step boundary, and resumed from there on any replica of the same model, with the frames
of a run never stopped, bit for bit.

A diffusion request's whole state between two steps is its latents and its scheduler's (the step index, and a
multistep solver's history: UniPC keeps its last model outputs); the text embeddings, the first frame's
conditioning and the initial noise are recomputed from the request's inputs as the pipeline's call computes them.
`capture` takes that state at a step boundary (from the step callback), and `ResumedScheduler` lets diffusers' own
call enter its loop at that step: its timesteps are the ones left, its state the one saved, so the loop, and every
request that is never stopped, runs diffusers' code unchanged.

Imports no Celery, no Redis; torch is imported inside the functions.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

CONFIG_KEYS = ("_internal_dict",)  # a scheduler's config: rebuilt from the model's, never saved


@dataclass(frozen=True)
class Checkpoint:
    """What resumes a request at step `step` of `total`: its latents after that step, and its scheduler's state,
    each tensor with the kind of device it lived on ("cpu" or "cuda"): a scheduler computes some of its
    coefficients on the CPU on purpose, and a resumed one must compute them where the first did."""

    step: int
    total: int
    latents: object  # a torch tensor, on the CPU
    scheduler: dict  # the scheduler's attributes but its config, tensors on the CPU
    devices: dict  # attribute name -> "cpu" or "cuda", for those holding tensors (a list's: its first tensor's)

    def to_bytes(self) -> bytes:
        import torch

        buffer = io.BytesIO()
        torch.save({"step": self.step, "total": self.total, "latents": self.latents, "scheduler": self.scheduler,
                    "devices": self.devices}, buffer)
        return buffer.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> "Checkpoint":
        """Tensors, numbers, lists and dicts only (weights_only): a checkpoint runs no code as it loads."""
        import torch

        fields = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        return cls(**fields)


def capture(scheduler, step: int, total: int, latents) -> Checkpoint:
    """The state of a request after its step `step` of `total` (1-based: `step` steps are done)."""
    state, devices = {}, {}
    for name, value in vars(scheduler).items():
        if name in CONFIG_KEYS:
            continue
        state[name], device = _to_cpu(value)
        if device is not None:
            devices[name] = device
    return Checkpoint(step=step, total=total, latents=latents.detach().to("cpu", copy=True), scheduler=state,
                      devices=devices)


def _to_cpu(value):
    """`value` with its tensors copied to the CPU, and the kind of device they were on (None: no tensor)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True), value.device.type
    if isinstance(value, (list, tuple)):
        items = [_to_cpu(v) for v in value]
        device = next((d for _, d in items if d is not None), None)
        return type(value)(v for v, _ in items), device
    return value, None


def _to_device(value, device: str):
    import torch

    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device) for v in value)
    return value


class ResumedScheduler:
    """A request's scheduler, resumed from `checkpoint`: it sets its timesteps as the scheduler sets them, then
    takes back the saved state, and shows the pipeline's loop only the timesteps left. Everything else is the
    scheduler's own (its step, its config, its order). `device`: where this replica computes (for the tensors that
    lived on a GPU)."""

    def __init__(self, scheduler, checkpoint: Checkpoint, device: str):
        object.__setattr__(self, "inner", scheduler)
        object.__setattr__(self, "checkpoint", checkpoint)
        object.__setattr__(self, "device", device)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __setattr__(self, name, value):
        setattr(self.inner, name, value)

    def set_timesteps(self, *args, **kwargs):
        self.inner.set_timesteps(*args, **kwargs)
        ck = self.checkpoint
        for name, value in ck.scheduler.items():
            where = ck.devices.get(name)
            setattr(self.inner, name, value if where is None else _to_device(value, "cpu" if where == "cpu" else
                                                                                 self.device))

    @property
    def timesteps(self):
        return self.inner.timesteps[self.checkpoint.step:]

    def set_begin_index(self, begin_index: int = 0) -> None:
        """The pipeline's loop sets 0; the saved state's step index stands."""
