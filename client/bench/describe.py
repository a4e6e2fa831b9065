"""`replicadp describe-model`: what a model weighs, component by component, and its transformer's FLOPs per
request: the figures for sizing a GPU and behind the bench's model FLOP utilisation."""

from __future__ import annotations

from rich.table import Table

from replicadp_tasks.architectures import ARCHITECTURES, describe, reference_flops
from replicadp_tasks.pipeline import RANDOM_PREFIX, TINY_SPECS

from ..progress import console


def architecture_of(spec: str) -> str:
    """The architecture that `spec` names (random:ARCH or ARCH, tiny or tiny-wan2.1); ValueError if none."""
    name = spec.removeprefix(RANDOM_PREFIX)
    name = f"tiny-{TINY_SPECS[name]}" if name in TINY_SPECS else name
    if name not in ARCHITECTURES:
        raise ValueError(f"{spec!r}: expected random:ARCH with ARCH one of {', '.join(sorted(ARCHITECTURES))}, or "
                         f"{', '.join(TINY_SPECS)}")
    return name


def figures(name: str, *, width: int, height: int, num_frames: int, steps: int, peak_tflops: float) -> dict:
    """Each component's parameters (built on the meta device: nothing is allocated) and the transformer's FLOPs
    for one request of that shape, guidance on."""
    return {"architecture": name, "components": describe(name),
            "request": {"width": width, "height": height, "num_frames": num_frames, "steps": steps, "guidance": True},
            "dit_flops": reference_flops(name, width=width, height=height, num_frames=num_frames, steps=steps),
            "peak_tflops": peak_tflops}


def print_figures(fig: dict) -> None:
    rows, req, flops, peak = fig["components"], fig["request"], fig["dit_flops"], fig["peak_tflops"]
    t = Table(title=f"{fig['architecture']}: parameters (meta device)")
    for col in ("component", "class", "parameters", "bf16", "served as"):
        t.add_column(col, justify="left" if col in ("component", "class") else "right")
    for r in rows:
        t.add_row(r["component"], r["class"], f"{r['parameters'] / 1e9:.3f} B", f"{r['bf16_bytes'] / 2**30:.2f} GiB",
                  f"{r['served_dtype']} {r['served_bytes'] / 2**30:.2f} GiB")
    total = sum(r["parameters"] for r in rows)
    t.add_row("total", "", f"{total / 1e9:.3f} B", f"{2 * total / 2**30:.2f} GiB",
              f"{sum(r['served_bytes'] for r in rows) / 2**30:.2f} GiB")
    console.print(t)
    console.print(f"transformer FLOPs per request ({req['width']}x{req['height']}, {req['num_frames']} frames, "
                  f"{req['steps']} steps, guidance on): {flops / 1e15:.2f} PFLOP; {flops / (peak * 1e12):.2f} s at "
                  f"{peak:g} TFLOP/s")
