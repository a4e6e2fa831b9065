"""A replica's layout over K processes (REPLICADP_PARALLEL): how its ranks split each denoising step, and what a
layout needs of the replica's devices, attention backend and model. How the ranks run it is parallel.py's."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..contract.errors import ModelLoadError

KINDS = ("ulysses", "ring", "cfg")
# Ring merges its blocks by the attention's log-sum-exp: the backends that return it (diffusers' names). On the
# CPU, "native" is made to (parallel.enable): torch's CPU flash kernel returns it.
RING_BACKENDS_CUDA = ("flash", "flash_hub", "_flash_3_hub", "_native_cudnn", "_native_flash", "sage")


@dataclass(frozen=True)
class Layout:
    """How a replica's ranks split each denoising step: the video tokens over ulysses x ring ranks, and the
    conditional and unconditional passes over cfg (1 or 2) groups of those."""

    ulysses: int = 1
    ring: int = 1
    cfg: int = 1

    @property
    def size(self) -> int:
        return self.ulysses * self.ring * self.cfg

    @property
    def sequence(self) -> int:
        """The ranks one pass's video tokens are split over."""
        return self.ulysses * self.ring

    def __str__(self) -> str:
        parts = [f"{kind}:{degree}" for kind, degree in asdict(self).items() if degree > 1]
        return ",".join(parts) or "none"

    @classmethod
    def parse(cls, text: str) -> "Layout":
        """`none`, or comma-separated KIND:DEGREE (ulysses:2, ulysses:2,ring:2); ValueError saying what is wrong."""
        text = text.strip().lower()
        if text in ("", "none"):
            return cls()
        degrees: dict[str, int] = {}
        for part in text.split(","):
            kind, _, degree = part.strip().partition(":")
            if kind not in KINDS:
                raise ValueError(f"{part.strip()!r}: expected KIND:DEGREE with KIND one of {', '.join(KINDS)}")
            if kind in degrees:
                raise ValueError(f"{kind} is given twice")
            if not (degree.isascii() and degree.isdigit() and int(degree) >= 1):
                raise ValueError(f"{part.strip()!r}: the degree must be a whole number of at least 1")
            degrees[kind] = int(degree)
        return cls(**degrees)


    def heads_refusal(self, heads: int) -> str | None:
        """Why a model of `heads` attention heads cannot run this layout (Ulysses gives each rank heads / degree),
        or None."""
        if heads % self.ulysses:
            return f"the model's {heads} attention heads do not split over {self.ulysses} ranks"
        return None


def check(layout: Layout, *, devices: list[str], device: str, attention: str) -> None:
    """Refuse, naming REPLICADP_PARALLEL, a layout this replica cannot run: a CFG degree other than 2, GPUs other
    than one per rank, ring on an attention backend without the log-sum-exp. Before anything is loaded (what a
    layout cannot be combined with is compatibility.py's)."""
    name = f"REPLICADP_PARALLEL={layout}"
    if layout.cfg > 2:
        raise ModelLoadError(f"{name}: a step has two passes (conditional, unconditional), so cfg is 1 or 2")
    if device == "cuda" and len(devices) != layout.size:
        raise ModelLoadError(f"{name} runs {layout.size} ranks, one per GPU, and this replica sees {len(devices)} "
                             f"GPU(s); set GPUS_PER_REPLICA={layout.size}")
    ring_backends = RING_BACKENDS_CUDA if device == "cuda" else ("native",)
    if layout.ring > 1 and attention not in ring_backends:
        raise ModelLoadError(f"{name} with REPLICADP_ATTENTION={attention!r}: ring attention needs a backend that "
                             f"returns the log-sum-exp; on {device}: {', '.join(ring_backends)}")


def check_heads(layout: Layout, heads: int) -> None:
    """Refuse, naming REPLICADP_PARALLEL, a Ulysses degree that does not divide the model's attention heads."""
    refusal = layout.heads_refusal(heads)
    if refusal:
        raise ModelLoadError(f"REPLICADP_PARALLEL={layout}: {refusal} (Ulysses gives each rank heads / degree); "
                             f"choose a degree that divides {heads}")
