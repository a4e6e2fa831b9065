"""The DiT's kernels on this GPU: one Wan transformer forward pass at the reference request's shape (832x480,
33 frames: 3510 video tokens, 512 text tokens), with random weights, for each attention backend, then with its
blocks compiled (regional torch.compile). Prints time per pass, TFLOP/s and model FLOP utilisation; writes JSON.
Part of scripts/gpu_check.sh; what wins here is what REPLICADP_ATTENTION / REPLICADP_COMPILE should default to.
A variant that fails (a backend without its package, a compile error) is recorded with its error, not fatal.

    python3 bench/gpu_kernels.py --out gpu-kernels.json
    python3 bench/gpu_kernels.py --device cpu --arch tiny-wan2.2-ti2v --size 64x64 --frames 5   # rehearsal
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from client.cli import size_param  # noqa: E402
from replicadp_tasks.contract import DEFAULTS, REFERENCE_SIZE  # noqa: E402
from replicadp_tasks.model.architectures import ARCHITECTURES, PEAK_TFLOPS, cast, dit_flops  # noqa: E402

BACKENDS = ("native", "_native_cudnn", "_native_flash", "_native_efficient", "flash", "_flash_3")


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def time_passes(model, inputs, device: str, warmup: int, passes: int) -> float:
    """Seconds per forward pass after `warmup` passes (the clock read after the device has finished)."""
    import torch

    with torch.inference_mode():
        for _ in range(warmup):
            model(**inputs, return_dict=False)
        sync(device)
        started = time.perf_counter()
        for _ in range(passes):
            model(**inputs, return_dict=False)
        sync(device)
    return (time.perf_counter() - started) / passes


def failure(exc: Exception) -> str:
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:100]}"


@click.command()
@click.option("--arch", default="wan2.2-ti2v-5b", show_default=True, type=click.Choice(sorted(ARCHITECTURES)))
@click.option("--frames", default=DEFAULTS["num_frames"], show_default=True)
@click.option("--size", default=REFERENCE_SIZE, show_default=True, callback=size_param, help="WIDTHxHEIGHT")
@click.option("--passes", default=5, show_default=True, help="Timed passes per variant.")
@click.option("--peak-tflops", default=PEAK_TFLOPS, show_default=True)
@click.option("--compile/--no-compile", "do_compile", default=True, show_default=True,
              help="Also time compiled blocks (regional compilation) with the fastest backend.")
@click.option("--device", default="cuda", show_default=True, type=click.Choice(["cuda", "cpu"]),
              help="cpu only rehearses the code path (no MFU): the figures are for a GPU.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), help="Write the figures as JSON.")
def main(arch, frames, size, passes, peak_tflops, do_compile, device, out):
    import torch
    from diffusers import WanTransformer3DModel

    if device == "cuda" and not torch.cuda.is_available():
        raise click.ClickException("no CUDA device: this measures GPU kernels (--device cpu rehearses)")
    if device == "cpu":
        peak_tflops = None
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    width, height = size
    a = ARCHITECTURES[arch]
    spatial, temporal = a.vae.get("scale_factor_spatial", 8), a.vae.get("scale_factor_temporal", 4)
    latent = (1, a.transformer["in_channels"], (frames - 1) // temporal + 1, height // spatial, width // spatial)
    tokens = latent[2] * (latent[3] // 2) * (latent[4] // 2)
    # 1. The transformer alone, random weights built on the GPU, bf16 as a replica serves it.
    torch.manual_seed(0)
    with torch.device(device):
        model = WanTransformer3DModel(**a.transformer).eval()
    cast(model, dtype)
    inputs = {
        "hidden_states": torch.randn(latent, device=device, dtype=dtype),
        "timestep": torch.full((1, tokens) if a.ti2v else (1,), 500, device=device, dtype=torch.long),
        "encoder_hidden_states": torch.randn(1, 512, a.transformer["text_dim"], device=device, dtype=dtype),
    }
    flops = dit_flops(a.transformer, tokens, 512, timestep_tokens=tokens if a.ti2v else 1)
    rows = []
    report = {"arch": arch, "tokens": tokens, "flops_per_pass": flops, "peak_tflops": peak_tflops,
              "device": device_name, "torch": torch.__version__, "fastest_backend": None, "compile": None,
              "rows": rows}

    def record(variant, seconds, note=""):
        """One variant's figures, printed and saved at once: a run cut short keeps what it measured."""
        rows.append({"variant": variant, "seconds_per_pass": seconds, "note": note,
                     "tflops_per_s": flops / seconds / 1e12 if seconds else None,
                     "mfu": flops / seconds / (peak_tflops * 1e12) if seconds and peak_tflops else None})
        print(f"{variant}: " + (f"{1000 * seconds:.1f} ms/pass" if seconds else note), flush=True)
        if out:
            out.write_text(json.dumps(report, indent=1))

    # 2. Each attention backend diffusers offers that can run here (flash-attn packages may be missing).
    for backend in BACKENDS:
        try:
            model.set_attention_backend(backend)
            record(f"attention={backend}", time_passes(model, inputs, device, 2, passes))
        except Exception as exc:  # a backend missing its package or refusing these shapes: report, go on
            record(f"attention={backend}", None, failure(exc))
    timed = [r for r in rows if r["seconds_per_pass"]]
    if not timed:
        raise click.ClickException(f"no attention backend ran: {rows}")
    best = report["fastest_backend"] = min(timed, key=lambda r: r["seconds_per_pass"])["variant"].split("=", 1)[1]
    # 3. Regional compilation with the fastest backend: the first pass pays the compile time.
    if do_compile:
        model.set_attention_backend(best)
        try:
            model.compile_repeated_blocks(fullgraph=True)
            started = time.perf_counter()
            with torch.inference_mode():
                model(**inputs, return_dict=False)
            sync(device)
            compile_s = time.perf_counter() - started
            record(f"attention={best} + compile=blocks", time_passes(model, inputs, device, 1, passes),
                   f"first pass (compiling) {compile_s:.1f} s")
            report["compile"] = rows[-1] | {"compile_s": compile_s}
        except Exception as exc:  # the uncompiled figures stand; the error says why compile=blocks can't be had
            record(f"attention={best} + compile=blocks", None, failure(exc))
    table = Table(title=f"{arch} transformer, one forward pass: {tokens} video tokens, 512 text tokens, "
                        f"{flops / 1e12:.1f} TFLOP ({device_name})")
    for col in ("variant", "ms / pass", "TFLOP/s", "MFU", "note"):
        table.add_column(col)
    for r in rows:
        s = r["seconds_per_pass"]
        table.add_row(r["variant"], f"{1000 * s:.1f}" if s else "-", f"{r['tflops_per_s']:.0f}" if s else "-",
                      f"{100 * r['mfu']:.1f}%" if r["mfu"] else "-", r["note"])
    Console(width=160).print(table)
    if out:
        out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
