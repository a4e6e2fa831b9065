"""Few-step serving against the exact model, in one process: the same model loaded twice in turn (the first freed
before the second loads), without a sampling recipe (the exact path: --steps, the model's guidance, CFG on) and
with one (REPLICADP_RECIPE, by default the 4-step no-CFG distillation's; a request leaves steps and guidance out
and gets the recipe's). Per path: the seconds per video (the pipeline call: text encoding, denoising loop, VAE
decode; median of the measured requests, after one warm-up), the denoising loop's seconds (the DiT's share), its
FLOPs per request, their rate and the model FLOP utilisation against --peak-tflops (a GPU's: on a CPU only the
ratios mean anything); then exact / few-step for seconds per video, the DiT loop and FLOPs. The FLOP ratio is
the speed-up a GPU sees in the loop (steps x passes a step); the time ratio adds what both paths share, the text
encoder and the VAE. Random or tiny weights make the few-step frames noise: no fidelity is measured here. Exit 0
when both paths ran. Part of scripts/gpu_check.sh (step 8); the CPU table is docs/benchmarks.md's (section 17).

    python3 bench/fewstep.py --model tiny --size 64x64 --num-frames 9 --requests 3             # tiny model, CPU
    python3 bench/fewstep.py --model random:wan2.2-ti2v-5b --size 832x480 --num-frames 33 --requests 2 \\
        --json fewstep.json                                                                  # the reference, on a GPU
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# The replica's reproducibility switches before anything imports torch, as bench/memory.py does: two holders are
# built here one after another.
from replicadp_tasks.model import determinism  # noqa: E402

determinism.set_environment()

import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import click  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from client.bench.run import PROMPTS  # noqa: E402
from client.cli import size_param  # noqa: E402
from replicadp_tasks.contract import ModelLoadError, validate_request  # noqa: E402
from replicadp_tasks.contract.recipe import parse_recipe  # noqa: E402
from replicadp_tasks.contract.request import DEFAULTS  # noqa: E402
from replicadp_tasks.model import PEAK_TFLOPS, TURBO_RECIPE, ModelOptions, PipelineHolder  # noqa: E402
from replicadp_tasks.settings import SETTINGS  # noqa: E402



def recipe_param(_ctx, _param, value: str) -> str:
    try:
        parse_recipe(value, "--recipe")  # refused here, before a model loads
    except ModelLoadError as exc:
        raise click.BadParameter(str(exc)) from exc
    return value


@click.command()
@click.option("--model", default="tiny", show_default=True, help="tiny, tiny-a14b, random:ARCH, a folder or a hub id.")
@click.option("--size", default="128x128", show_default=True, callback=size_param, help="WIDTHxHEIGHT")
@click.option("--num-frames", "--frames", "frames", default=17, show_default=True)
@click.option("--steps", default=DEFAULTS["num_inference_steps"], show_default=True, help="The exact path's steps.")
@click.option("--recipe", default=TURBO_RECIPE, show_default=True, callback=recipe_param,
              help="The few-step path's REPLICADP_RECIPE (a TOML inline table).")
@click.option("--requests", default=3, show_default=True, type=click.IntRange(1),
              help="Measured requests per path (distinct inputs).")
@click.option("--threads", default=1, show_default=True, help="CPU threads (a CPU replica's REPLICADP_THREADS).")
@click.option("--peak-tflops", default=PEAK_TFLOPS, show_default=True, help="The chip's peak, for MFU.")
@click.option("--json", "--out", "out", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the figures as JSON here (after each path: a run cut short keeps the path done).")
def main(model, size, frames, steps, recipe, requests, threads, peak_tflops, out):
    import torch

    started = time.time()
    report = {"model": model, "device": None, "machine": platform.processor() or platform.machine(),
              "size": f"{size[0]}x{size[1]}", "frames": frames, "steps": steps, "recipe": recipe,
              "requests": requests, "threads": threads, "peak_tflops": peak_tflops, "seconds": None, "rows": []}

    def write() -> None:
        report["seconds"] = round(time.time() - started, 1)
        if out:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(report, indent=1, default=float))

    def request(holder: PipelineHolder, i: int, exact: bool):
        """Input i (prompt i mod the pool, seed 42 + i); the few-step path leaves steps and guidance to the recipe,
        the exact one gives --steps and leaves guidance to the model."""
        fields = {"prompt": PROMPTS[i % len(PROMPTS)], "seed": 42 + i, "width": size[0], "height": size[1],
                  "num_frames": frames}
        return validate_request(fields | ({"num_inference_steps": steps} if exact else {}), holder.accepts)

    for name, text in (("exact", None), ("few-step", recipe)):
        holder = PipelineHolder(ModelOptions(model, model_cache=SETTINGS.model_cache, threads=threads,
                                attention=SETTINGS.attention, deterministic=SETTINGS.deterministic, recipe=text))
        t0 = time.perf_counter()
        try:
            holder.load()
        except ModelLoadError as exc:
            raise click.ClickException(f"the {name} path did not load: {exc}") from exc
        load_s = time.perf_counter() - t0
        report["device"] = holder.device
        runs = []
        for n, i in enumerate([10_000, *range(requests)]):  # a warm-up first
            req = request(holder, i, name == "exact")
            t0 = time.perf_counter()
            holder.generate(req)
            request_s = time.perf_counter() - t0
            if n:
                stats = holder.last_run
                runs.append({"request_s": request_s, "dit_s": stats.dit_s, "dit_flops": stats.dit_flops,
                             "peak_memory_gib": stats.peak_memory_gib})
        dit = [r["dit_s"] for r in runs if r["dit_s"] is not None]  # None: a 1-step loop is not timed
        row = {"path": name, "recipe": holder.recipe.describe() if holder.recipe else None,
               "steps": req.num_inference_steps, "guidance_scale": req.guidance_scale,
               "guidance_scale_2": req.guidance_scale_2, "load_s": round(load_s, 3),
               "request_s": statistics.median(r["request_s"] for r in runs),
               "dit_s": statistics.median(dit) if dit else None,
               "dit_flops": statistics.median(r["dit_flops"] for r in runs),
               "peak_memory_gib": max((r["peak_memory_gib"] or 0 for r in runs), default=None) or None, "runs": runs}
        rate = row["dit_flops"] / row["dit_s"] if row["dit_s"] else None
        row |= {"dit_tflops_per_s": rate and rate / 1e12, "mfu": rate and rate / (peak_tflops * 1e12)}
        report["rows"].append(row)
        write()
        # The second path's weights must not meet the first's on the device.
        del holder
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    exact, few = report["rows"]
    report["speedup"] = {"request": exact["request_s"] / few["request_s"],
                         "dit": exact["dit_s"] / few["dit_s"] if exact["dit_s"] and few["dit_s"] else None,
                         "flops": exact["dit_flops"] / few["dit_flops"]}
    write()

    up = report["speedup"]
    table = Table(title=f"few-step serving: {model} on {report['device']}, {size[0]}x{size[1]}x{frames}, "
                        f"{requests} requests per path (medians); MFU against {peak_tflops:g} TFLOP/s")
    for col in ("path", "sampling", "s/video", "DiT loop s", "DiT GFLOP", "TFLOP/s", "MFU", "peak GiB"):
        table.add_column(col, justify="left" if col in ("path", "sampling") else "right")
    for r in report["rows"]:
        sampling = r["recipe"] or f"{r['steps']} steps, guidance {r['guidance_scale']:g}, model's scheduler"
        table.add_row(r["path"], sampling, f"{r['request_s']:.3f}", f"{r['dit_s']:.3f}" if r["dit_s"] else "-",
                      f"{r['dit_flops'] / 1e9:.4g}", f"{r['dit_tflops_per_s']:.3g}" if r["mfu"] else "-",
                      f"{100 * r['mfu']:.3g}%" if r["mfu"] else "-",
                      f"{r['peak_memory_gib']:.2f}" if r["peak_memory_gib"] else "-")
    table.add_row("exact / few-step", "", f"{up['request']:.2f}x", f"{up['dit']:.2f}x" if up["dit"] else "-",
                  f"{up['flops']:.2f}x", "", "", "")
    console = Console(width=150)
    console.print(table)


if __name__ == "__main__":
    main()
