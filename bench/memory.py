"""Each memory option (REPLICADP_OFFLOAD) against `none`, one fresh pipeline per option in one process: the weights
it keeps on the device (memory.needs), the load time, the request time and the denoising loop's, the peak memory,
and whether each request's frames equal `none`'s for the same input bit for bit (no option may change them: a
difference is a bug, and the exit status is 1). `none` runs first. Part of scripts/gpu_check.sh; the CPU table is
docs/benchmarks.md's.

    python3 bench/memory.py --out bench-results/memory-cpu.json                            # tiny A14B, CPU
    python3 bench/memory.py --model random:wan2.2-t2v-a14b --size 832x480 --frames 17 --steps 4 \\
        --requests 1 --out memory.json                                                   # on a GPU
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# The replica's reproducibility switches before anything imports torch: without MKL_CBWR, MKL's results depend on
# its operands' alignment, which differs between the holders built here one after another (determinism.py).
from replicadp_tasks.model import determinism  # noqa: E402

determinism.set_environment()

import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import click  # noqa: E402
import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from client.bench.run import PROMPTS  # noqa: E402
from client.cli import size_param  # noqa: E402
from replicadp_tasks.contract import Accepts, ModelLoadError, validate_request  # noqa: E402
from replicadp_tasks.model import ModelOptions, Offload, PipelineHolder, memory  # noqa: E402
from replicadp_tasks.settings import SETTINGS  # noqa: E402


def options_param(_ctx, _param, value: str) -> list[Offload]:
    try:
        chosen = [Offload(v.strip()) for v in value.split(",") if v.strip()]
    except ValueError as exc:
        raise click.BadParameter(f"{exc}; choices: {', '.join(Offload)}") from exc
    # `none` is the baseline the others' frames are compared with: always measured, first.
    return [Offload.NONE, *(o for o in Offload if o in chosen and o != Offload.NONE)]


@click.command()
@click.option("--model", default="random:tiny-wan2.2-t2v-a14b", show_default=True,
              help="random:ARCH, tiny, tiny-a14b, a folder or a hub id (`expert` needs two experts).")
@click.option("--size", default="128x128", show_default=True, callback=size_param, help="WIDTHxHEIGHT")
@click.option("--frames", default=17, show_default=True)
@click.option("--steps", default=8, show_default=True)
@click.option("--requests", default=4, show_default=True, help="Measured requests per option (distinct inputs).")
@click.option("--threads", default=1, show_default=True, help="CPU threads (a CPU replica's REPLICADP_THREADS).")
@click.option("--options", default=",".join(Offload), show_default=True, callback=options_param,
              help="Comma-separated REPLICADP_OFFLOAD values; `none` always runs, first.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the figures as JSON here (after each option: a run cut short keeps the rows done).")
def main(model, size, frames, steps, requests, threads, options, out):
    import torch

    started = time.time()
    report = {"model": model, "device": None, "machine": platform.processor() or platform.machine(),
              "size": f"{size[0]}x{size[1]}", "frames": frames, "steps": steps, "requests": requests,
              "threads": threads, "options": [str(o) for o in options], "seconds": None, "rows": []}

    def write() -> None:
        report["seconds"] = round(time.time() - started, 1)
        if out:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(report, indent=1, default=float))

    def request(holder: PipelineHolder, i: int):
        """Input i: prompt i mod the pool, seed 42 + i."""
        return validate_request({"prompt": PROMPTS[i % len(PROMPTS)], "seed": 42 + i, "width": size[0],
                                 "height": size[1], "num_frames": frames, "num_inference_steps": steps},
                                Accepts(size_multiple=holder.size_multiple, experts=holder.expert_count,
                                        qualities=tuple(holder.qualities)))

    baseline: list[np.ndarray] = []  # none's frames, by measured input
    reasons: dict[Offload, str | None] = {}  # why an option cannot serve this model (memory.usable), from none's
    for option in options:
        if reasons.get(option):
            report["rows"].append({"option": str(option), "skipped": reasons[option]})
            write()
            continue
        holder = PipelineHolder(ModelOptions(model, model_cache=SETTINGS.model_cache, threads=threads,
                                attention=SETTINGS.attention, deterministic=SETTINGS.deterministic, offload=option))
        t0 = time.perf_counter()
        try:
            holder.load()
        except ModelLoadError as exc:  # e.g. does not fit this device: reported, the next option goes on
            report["rows"].append({"option": str(option), "skipped": str(exc)})
            write()
            if option == Offload.NONE:
                raise click.ClickException(f"the baseline (none) did not load: {exc}") from exc
            continue
        load_s = time.perf_counter() - t0
        report["device"] = holder.device
        models = memory.models_of(holder.pipe)
        if option == Offload.NONE:
            reasons = {o: memory.usable(o, models, holder.devices) for o in options}
        need = memory.needs(models, option, memory.Devices(holder.devices, [None] * len(holder.devices),
                                                          streamed=holder.device == "cuda"))
        runs = []
        for n, i in enumerate([10_000, *range(requests)]):  # a warm-up first
            req = request(holder, i)
            t0 = time.perf_counter()
            frames_out = holder.generate(req)
            request_s = time.perf_counter() - t0
            if n == 0:
                continue
            if option == Offload.NONE:
                baseline.append(frames_out)
            runs.append({"request_s": request_s, "dit_s": holder.last_run.dit_s,
                         "peak_memory_gib": holder.last_run.peak_memory_gib,
                         "same_as_none": bool(np.array_equal(frames_out, baseline[n - 1]))})
        dit = [r["dit_s"] for r in runs if r["dit_s"] is not None]
        report["rows"].append({
            "option": str(option), "skipped": None, "weights_on_device_bytes": max(n.total for n in need),
            "load_s": round(load_s, 3), "request_s": statistics.median(r["request_s"] for r in runs),
            "dit_s": statistics.median(dit) if dit else None,
            "peak_memory_gib": max(r["peak_memory_gib"] for r in runs),
            "same_as_none": sum(r["same_as_none"] for r in runs), "runs": runs})
        write()
        # The next option's weights must not meet this one's on the device.
        del holder, models
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    rows = report["rows"]
    base = rows[0]
    differ = [r["option"] for r in rows if not r["skipped"] and r["same_as_none"] != requests]
    title = (f"memory options: {model} on {report['device']}, {size[0]}x{size[1]}x{frames}, {steps} steps, "
             f"{requests} requests per option (medians)")
    if differ:
        title += f"; FRAMES DIFFER from none's with {', '.join(differ)}: a bug"
    table = Table(title=title)
    for col in ("option", "weights on device", "load s", "request s", "x none", "DiT loop s", "peak GiB",
                "same frames as none"):
        table.add_column(col, justify="left" if col == "option" else "right")
    for r in rows:
        if r["skipped"]:
            table.add_row(r["option"], "skipped (below)", *[""] * 6)
            continue
        table.add_row(r["option"], memory.size(r["weights_on_device_bytes"]), f"{r['load_s']:.2f}",
                      f"{r['request_s']:.3f}", f"{r['request_s'] / base['request_s']:.2f}",
                      f"{r['dit_s']:.3f}" if r["dit_s"] else "-", f"{r['peak_memory_gib']:.2f}",
                      f"{r['same_as_none']}/{requests}")
    console = Console(width=150)
    console.print(table)
    for r in rows:
        if r["skipped"]:
            console.print(f"{r['option']} skipped: {r['skipped']}", highlight=False)
    write()
    if differ:
        print(f"bench/memory.py: frames differ from REPLICADP_OFFLOAD=none's with {', '.join(differ)}: no memory "
              "option may change a request's output", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
