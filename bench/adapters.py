"""What switching LoRA adapters per request costs (adapters.py): on one pipeline holder of the tiny model with two
tiny adapters registered (made here, seeded), (a) the switch itself, `activate` of a request's adapters then
`deactivate`, timed over many rounds for one and for two adapters; (b) whole requests without adapters, with one
and with two, in turn, and on a holder with none registered, so that what an active adapter adds per step, and
what registered but switched-off adapters cost, show too. docs/benchmarks.md,
section 13.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/adapters.py --out bench-results/adapters-cpu.json
"""

from __future__ import annotations

import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from replicadp_tasks.contract import validate_request  # noqa: E402
from replicadp_tasks.model import ModelOptions, PipelineHolder, adapters, resolve_model, save_tiny_lora  # noqa: E402
from replicadp_tasks.settings import SETTINGS  # noqa: E402

CHOICES = {"none": [], "one": [{"name": "style"}], "two": [{"name": "style"}, {"name": "motion", "scale": 0.5}]}


def ms(samples: list[float]) -> dict:
    return {"p50_ms": 1000 * statistics.median(samples), "max_ms": 1000 * max(samples)}


@click.command()
@click.option("--model", default="tiny", show_default=True, help="A tiny model (its adapters are made for it).")
@click.option("--rounds", default=200, show_default=True, help="Switches timed per case.")
@click.option("--requests", default=10, show_default=True, help="Requests per case, in turn.")
@click.option("--size", default="64x64", show_default=True)
@click.option("--frames", default=5, show_default=True)
@click.option("--steps", default=8, show_default=True)
@click.option("--threads", default=1, show_default=True)
@click.option("--json", "json_out", is_flag=True, help="Print the report as JSON on stdout.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), help="Write the report as JSON here.")
def main(model, rounds, requests, size, frames, steps, threads, json_out, out):
    console = Console(stderr=json_out, width=150)
    folder = Path(tempfile.mkdtemp(prefix="bench-adapters-"))
    try:
        report = run(folder, model, rounds, requests, size, frames, steps, threads)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print_report(console, report)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))
    if json_out:
        print(json.dumps(report, indent=1))


def run(folder: Path, model: str, rounds: int, requests: int, size: str, frames: int, steps: int,
        threads: int) -> dict:
    """The switches and the requests, timed (see the module's docstring)."""
    model_dir = resolve_model(model, SETTINGS.model_cache)
    for name, seed in (("style", 1), ("motion", 2)):
        save_tiny_lora(model_dir, folder / f"{name}.safetensors", seed)
    registry = folder / "loras.toml"
    registry.write_text("".join(f'[adapters.{n}]\nsource = "{folder}/{n}.safetensors"\n' for n in ("style", "motion")))
    holder = PipelineHolder(ModelOptions(model, model_cache=SETTINGS.model_cache, threads=threads, loras_file=str(registry)))
    started = time.perf_counter()
    holder.load()
    load_s = time.perf_counter() - started
    width, height = (int(x) for x in size.lower().split("x"))
    reqs = {case: validate_request({"prompt": "a fox", "seed": 1, "width": width, "height": height,
                                    "num_frames": frames, "num_inference_steps": steps,
                                    **({"loras": loras} if loras else {})}, loras=holder.lora_scales)
            for case, loras in CHOICES.items()}
    switches = {}
    for case in ("one", "two"):
        on, off = [], []
        for _ in range(rounds):
            t0 = time.perf_counter()
            adapters.activate(holder.pipe, reqs[case].loras)
            t1 = time.perf_counter()
            adapters.deactivate(holder.pipe)
            off.append(time.perf_counter() - t1)
            on.append(t1 - t0)
        switches[case] = {"activate": ms(on), "deactivate": ms(off)}
    bare = PipelineHolder(ModelOptions(model, model_cache=SETTINGS.model_cache, threads=threads))
    bare.load()
    times = {case: [] for case in (*CHOICES, "none registered")}
    holder.generate(reqs["none"])  # warm-up
    bare.generate(reqs["none"])
    for _ in range(requests):
        for case, req in (*reqs.items(), ("none registered", reqs["none"])):
            t0 = time.perf_counter()
            (bare if case == "none registered" else holder).generate(req)
            times[case].append(time.perf_counter() - t0)
    return {"model": model, "machine": platform.processor() or platform.machine(), "threads": threads,
            "size": size, "frames": frames, "steps": steps, "rounds": rounds, "requests": requests,
            "load_s_with_two_adapters": load_s, "switch": switches,
            "request": {case: ms(t) for case, t in times.items()}}


def print_report(console: Console, report: dict) -> None:
    model, threads, size, frames, steps = (report[k] for k in ("model", "threads", "size", "frames", "steps"))
    switches = report["switch"]
    table = Table(title=f"LoRA switching, {model} with 2 tiny adapters (rank 4, q/k/v/out of every attention), "
                        f"{threads} thread")
    for col in ("adapters", "activate p50 ms", "deactivate p50 ms", f"request p50 ms ({size}x{frames}, {steps} steps)",
                "vs none registered"):
        table.add_column(col, justify="left" if col == "adapters" else "right")
    base = report["request"]["none registered"]["p50_ms"]
    for case in ("none registered", *CHOICES):
        sw = switches.get(case)
        req = report["request"][case]["p50_ms"]
        table.add_row(case, f"{sw['activate']['p50_ms']:.2f}" if sw else "-",
                      f"{sw['deactivate']['p50_ms']:.2f}" if sw else "-", f"{req:.1f}", f"{req - base:+.1f}")
    console.print(table)


if __name__ == "__main__":
    main()
