"""Each step cache against the exact path, in one run on one loaded pipeline: the denoising loop's time and the
whole request's (pipeline and MP4 encoding), the share of the transformer blocks' work skipped, and the fidelity
(PSNR of the frames against the exact path's, same inputs). MagCache is calibrated first, on this model, at this
step count (`replicadp calibrate-mag`'s code). Part of scripts/gpu_check.sh; the CPU table is docs/benchmarks.md's.

    python3 bench/step_cache.py --out bench-results/step-cache-cpu.json                   # tiny model, CPU
    python3 bench/step_cache.py --model random:wan2.2-ti2v-5b --size 832x480 --frames 33 --steps 30 \\
        --requests 1 --out step-cache.json                                               # the reference, on a GPU
"""

from __future__ import annotations

import json
from dataclasses import replace
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from client.bench.isolation import psnr_db  # noqa: E402
from client.bench.run import PROMPTS  # noqa: E402
from client.cli import size_param  # noqa: E402
from replicadp_tasks.contract import Accepts, validate_request  # noqa: E402
from replicadp_tasks.model import CacheMethod, ModelOptions, PipelineHolder, StepCache, calibrate_mag  # noqa: E402
from replicadp_tasks.model.step_cache import count_block_work  # noqa: E402
from replicadp_tasks.outputs import encode_mp4  # noqa: E402
from replicadp_tasks.settings import SETTINGS  # noqa: E402

METHODS = [m for m in CacheMethod if m != CacheMethod.NONE]


@click.command()
@click.option("--model", default="tiny", show_default=True, help="tiny, random:ARCH, a folder or a hub id.")
@click.option("--size", default="128x128", show_default=True, callback=size_param, help="WIDTHxHEIGHT")
@click.option("--frames", default=17, show_default=True)
@click.option("--steps", default=30, show_default=True)
@click.option("--requests", default=4, show_default=True, help="Measured requests per path (distinct inputs).")
@click.option("--threads", default=1, show_default=True, help="CPU threads (a CPU replica's REPLICADP_THREADS).")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), help="Write the figures as JSON here.")
def main(model, size, frames, steps, requests, threads, out):
    started = time.time()
    holder = PipelineHolder(ModelOptions(model, model_cache=SETTINGS.model_cache, threads=threads, attention=SETTINGS.attention,
                            deterministic=SETTINGS.deterministic))
    holder.load()
    calls = count_block_work(holder.pipe.transformer)

    def request(i: int, quality: str):
        """Input i (prompt i mod the pool, seed 42 + i) on the path `quality`."""
        return validate_request({"prompt": PROMPTS[i % len(PROMPTS)], "seed": 42 + i, "width": size[0],
                                 "height": size[1], "num_frames": frames, "num_inference_steps": steps,
                                 "quality": quality}, Accepts(size_multiple=holder.size_multiple))

    def once(req) -> dict:
        calls["n"] = 0
        t0 = time.perf_counter()
        frames_out = holder.generate(req)
        encode_mp4(frames_out, req.fps)
        return {"request_s": time.perf_counter() - t0, "dit_s": holder.last_run.dit_s, "block_calls": calls["n"],
                "frames": frames_out}

    # 1. MagCache's ratios for this model and step count, on the exact path (what calibrate-mag writes).
    t0 = time.perf_counter()
    ratios = calibrate_mag(holder, [request(20_000 + i, "standard") for i in range(2)])
    calibration_s = time.perf_counter() - t0
    ratios_file = Path(SETTINGS.model_cache) / "bench-mag-ratios.json"
    ratios_file.parent.mkdir(parents=True, exist_ok=True)
    ratios_file.write_text(json.dumps({"model": model, "mag_ratios": ratios}))
    paths = {"exact": StepCache.of(CacheMethod.NONE)}
    paths |= {m.value: StepCache.of(m, mag_ratios_path=ratios_file, model=model) for m in METHODS}
    ratios_file.unlink()
    # 2. Each path on the same inputs, the paths taken in turn for each input: the machine's drift over the run
    #    (this VM's speed moves by up to 20% over tens of seconds) falls on all of them alike. A warm-up first.
    rows: dict[str, list] = {name: [] for name in paths}
    for i in [10_000, *range(requests)]:
        for name, cache in paths.items():
            holder.options = replace(holder.options, cache=cache)  # installed per fast request: no reload
            row = once(request(i, "standard" if name == "exact" else "fast"))
            if i != 10_000:
                rows[name].append(row)
    exact = rows["exact"]

    def summary(name: str) -> dict:
        cache, rows_ = None if name == "exact" else str(paths[name]), rows[name]
        psnr = [psnr_db(r["frames"], e["frames"]) for r, e in zip(rows_, exact)]
        finite = [p for p in psnr if math.isfinite(p)]
        dit = [r["dit_s"] for r in rows_ if r["dit_s"] is not None]
        return {"path": name, "cache": cache,
                "dit_s": statistics.median(dit) if dit else None,
                "request_s": statistics.median(r["request_s"] for r in rows_),
                "blocks_skipped": 1 - sum(r["block_calls"] for r in rows_) / sum(e["block_calls"] for e in exact),
                "psnr_db_min": min(psnr), "psnr_db_mean": statistics.mean(finite) if finite else math.inf,
                "identical": sum(not math.isfinite(p) for p in psnr)}

    figures = [summary(name) for name in paths]
    base = figures[0]
    for f in figures:
        f["dit_speedup"] = base["dit_s"] / f["dit_s"] if f["dit_s"] and base["dit_s"] else None
        f["request_speedup"] = base["request_s"] / f["request_s"]
    report = {"model": model, "device": holder.device, "machine": platform.processor() or platform.machine(),
              "size": f"{size[0]}x{size[1]}", "frames": frames, "steps": steps, "requests": requests,
              "threads": threads, "calibration_s": round(calibration_s, 2), "mag_ratios": ratios,
              "seconds": round(time.time() - started, 1), "rows": figures}

    table = Table(title=f"step caches: {model} on {holder.device}, {size[0]}x{size[1]}x{frames}, {steps} steps, "
                        f"{requests} requests per path (medians)")
    for col in ("path", "knob", "DiT loop s", "x", "request s", "x", "blocks skipped", "PSNR dB min / mean"):
        table.add_column(col, justify="left" if col in ("path", "knob") else "right")
    for f in figures:
        knob = f["cache"].split(" ", 1)[1] if f["cache"] and " " in f["cache"] else ""
        psnr = "exact" if f["path"] == "exact" else f"{f['psnr_db_min']:.1f} / {f['psnr_db_mean']:.1f}"
        table.add_row(f["path"], knob, f"{f['dit_s']:.3f}" if f["dit_s"] else "-",
                      f"{f['dit_speedup']:.2f}" if f["dit_speedup"] else "-", f"{f['request_s']:.3f}",
                      f"{f['request_speedup']:.2f}", f"{100 * f['blocks_skipped']:.0f}%", psnr)
    Console(width=150).print(table)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1, default=float))


if __name__ == "__main__":
    main()
