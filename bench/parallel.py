"""Replicas over K processes (REPLICADP_PARALLEL) against replicas of one, on the same cores: in one run,
(a) N replicas x 1 process under a closed loop of N requests in flight and (c) 1 x 1 one request at a time;
then for each `--layout` of K ranks, (b) N/K replicas x K under the same loop and (c) 1 x K one request at a time
(single-request latency). (a) writes replicadp's isolation baseline and the others check it, so that each input's
frames are compared across layouts: bitwise (the frames' SHA-256) and, for the decoded MP4s, max abs difference
and PSNR. It prints first the model of 8 H200s as 8x1, 4x2, 2x4, 1x8 of each kind (arithmetic, nothing run;
`--model-only` prints only that). docs/benchmarks.md section 12.

    python3 bench/parallel.py --layout ulysses:2 --layout ring:2 --layout cfg:2 --out bench-results/parallel-cpu.json
    python3 bench/parallel.py --model-only                                # the H200 model, no run
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
import numpy as np
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from client.bench.isolation import psnr_db  # noqa: E402
from replicadp_tasks.model.architectures import (PEAK_TFLOPS, architecture, reference_expert_flops, video_tokens)  # noqa: E402
from replicadp_tasks.outputs import decode_mp4  # noqa: E402

# The replicadp command of this interpreter (the .venv here, the carried wheels on a GPU machine).
CLI = [sys.executable, "-m", "client"]
# The model's assumption on the link: NVLink 4 on an H200 moves 900 GB/s in both directions together, about
# 450 GB/s each way per GPU (NVIDIA's datasheet figure, not measured here; an all-to-all reaches less).
NVLINK_GBPS = 450.0
# Ring merges its blocks by the log-sum-exp and so rounds otherwise than one process: a frame within this PSNR of
# the baseline's passes the check (counted apart from the bitwise matches: "tolerated").
TOLERANCE_PSNR = 40.0


@contextlib.contextmanager
def deployment(replicas: int, parallel: str, threads: int, model: str, devices: str):
    """`replicadp up` of `replicas` replicas with REPLICADP_PARALLEL=`parallel` on `devices` (cpu, or GPU ids: each
    replica takes one per rank), in a state dir of its own; always `replicadp down` after. Yields the environment
    that `replicadp bench` needs to reach it."""
    state = tempfile.mkdtemp(prefix="bench-parallel-")
    env = {**os.environ, "REPLICADP_STATE_DIR": state, "REPLICADP_PARALLEL": parallel,
           "REPLICADP_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    env.pop("REDIS_URL", None)
    try:
        cpu = ["--threads", str(threads)] if devices == "cpu" else []
        subprocess.run([*CLI, "up", "--replicas", str(replicas), *cpu, "--devices", devices, "--model", model],
                       env=env, check=True, stdout=subprocess.DEVNULL)
        yield env
    finally:
        subprocess.run([*CLI, "down"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        shutil.rmtree(state, ignore_errors=True)


def bench(env: dict, work: Path, name: str, *, concurrency: int, requests: int, warmup: int, size: str,
          frames: int, steps: int, baseline: Path, write: bool) -> dict:
    """One `replicadp bench` run (its report), its MP4s saved under work/name."""
    out = work / f"{name}.json"
    subprocess.run([*CLI, "bench", "--concurrency", str(concurrency), "--num-requests", str(requests),
                    "--warmup", str(warmup), "--size", size, "--num-frames", str(frames), "--steps", str(steps),
                    "--label", name, "--save-dir", str(work / name), "--json", str(out),
                    *(["--write-baseline", str(baseline)] if write else
                      ["--check-baseline", str(baseline), "--tolerance-psnr", str(TOLERANCE_PSNR)])],
                   env=env, check=True, stderr=subprocess.DEVNULL)
    return json.loads(out.read_text())


def frame_diffs(work: Path, name: str, reference: str) -> dict:
    """Each saved video of run `name` against the same input's in run `reference` (the same file name: index
    and seed): decoded frames' max abs difference and PSNR."""
    diffs = []
    for mp4 in sorted((work / name).glob("*.mp4")):
        a, b = decode_mp4(mp4.read_bytes()), decode_mp4((work / reference / mp4.name).read_bytes())
        diffs.append({"video": mp4.name, "max_abs": int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max()),
                      "psnr_db": psnr_db(a, b)})
    finite = [d["psnr_db"] for d in diffs if math.isfinite(d["psnr_db"])]
    return {"videos": len(diffs), "max_abs": max((d["max_abs"] for d in diffs), default=None),
            "psnr_db_min": min(finite) if finite else None, "identical_decoded": len(diffs) - len(finite)}


def summary(rep: dict, layout: str, parallel: str, diffs: dict | None) -> dict:
    iso = rep.get("isolation", {})
    return {"layout": layout, "parallel": parallel, "replicas": rep["replicas"],
            "concurrency": rep["config"]["concurrency"],
            "completed": rep["completed"], "failed": rep["failed"], "latency_p50_s": rep["latency_s"]["p50"],
            "dit_p50_s": rep["dit_s"]["p50"], "inference_p50_s": rep["inference_s"]["p50"],
            "videos_per_min": rep["videos_per_min"],
            "frames_identical": iso.get("matched") if "baseline" in iso else None,
            "frames_tolerated": iso.get("tolerated") if "baseline" in iso else None,
            "frames_mismatched": iso.get("mismatched") if "baseline" in iso else None, "decoded": diffs}


# The layouts the model prices for 8 GPUs: one per replica size K, and each kind at K = 2 and 4.
MODEL_LAYOUTS = ("none", "ulysses:2", "ring:2", "cfg:2", "ulysses:4", "ring:4", "cfg:2,ulysses:2", "ulysses:8",
                 "cfg:2,ulysses:4")


def model_rows(arch_name: str, size: tuple[int, int], frames: int, steps: int, gpus: int) -> list[dict]:
    """`gpus` H200s as gpus/K replicas of each layout in MODEL_LAYOUTS (K ranks), from the transformer's FLOPs at
    PEAK_TFLOPS and each kind's bytes over NVLINK_GBPS. Transformer only (text encoder and VAE left out), guidance
    on (two passes a step), no overlap of communication and compute. Per rank, per step:
    - Ulysses (degree u, over the tokens/r of its ring slice): per attention layer and pass, 4 all-to-alls (q, k, v
      in; the output back), each sending (u-1)/u of the rank's tokens x hidden on its links;
    - ring (degree r, on the heads/u Ulysses leaves it): per attention layer and pass, r-1 turns, each passing
      a key and a value block of tokens/(u r) x hidden/u;
    - cfg:2: each rank runs one of the two passes (half the compute and the sequence traffic), then one
      all-gather of the pass's output (the latent: tokens x out_channels x patch volume).
    """
    from replicadp_tasks.model import Layout

    arch = architecture(arch_name)
    cfg = arch.transformer
    width, height = size
    experts = reference_expert_flops(arch_name, height=height, width=width, num_frames=frames, steps=steps)
    flops = sum(e["dit_flops"] for e in experts.values())
    tokens = video_tokens(cfg, height=height, width=width, num_frames=frames,
                          vae_spatial=arch.vae.get("scale_factor_spatial", 8),
                          vae_temporal=arch.vae.get("scale_factor_temporal", 4))
    hidden = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    out_per_token = cfg["out_channels"] * math.prod(cfg["patch_size"])
    rows = []
    for text in MODEL_LAYOUTS:
        layout = Layout.parse(text)
        u, r, c, k = layout.ulysses, layout.ring, layout.cfg, layout.size
        if gpus % k or cfg["num_attention_heads"] % u:
            continue
        passes = 2 // c  # the passes of a step this rank runs
        mine = tokens / (u * r)  # the video tokens this rank holds
        ulysses = 4 * mine * hidden * 2 * (u - 1) / u
        ring = 2 * (r - 1) * mine * (hidden / u) * 2
        gather = mine * out_per_token * 2 * (c - 1)
        step_bytes = passes * cfg["num_layers"] * (ulysses + ring) + gather
        compute = flops / k / (PEAK_TFLOPS * 1e12)
        comms_step = step_bytes / (NVLINK_GBPS * 1e9)
        latency = compute + steps * comms_step
        rows.append({"layout": f"{gpus // k}x{k}", "parallel": text, "replicas": gpus // k, "ranks": k,
                     "tokens": tokens, "request_tflops": flops / 1e12, "compute_step_s": compute / steps,
                     "gb_per_step_per_rank": step_bytes / 1e9, "comms_step_s": comms_step,
                     "latency_s": latency, "videos_per_min": gpus // k * 60 / latency})
    return rows


def print_model(console: Console, arch_name: str, size, frames: int, steps: int, gpus: int) -> list[dict]:
    rows = model_rows(arch_name, size, frames, steps, gpus)
    table = Table(title=f"MODEL, not a measurement: {arch_name} on {gpus} H200s, {size[0]}x{size[1]}x{frames}, "
                        f"{steps} steps, {rows[0]['tokens']} tokens, {rows[0]['request_tflops']:.0f} TFLOP/request, "
                        f"{PEAK_TFLOPS:.0f} TFLOP/s, NVLink {NVLINK_GBPS:.0f} GB/s (assumed)")
    for col in ("replicas x K", "REPLICADP_PARALLEL", "compute/step s", "GB/step/rank", "comms/step s",
                "latency s", "videos/min"):
        table.add_column(col, justify="left" if col in ("replicas x K", "REPLICADP_PARALLEL") else "right")
    for r in rows:
        table.add_row(r["layout"], r["parallel"], f"{r['compute_step_s']:.3f}", f"{r['gb_per_step_per_rank']:.2f}",
                      f"{r['comms_step_s']:.4f}", f"{r['latency_s']:.1f}", f"{r['videos_per_min']:.2f}")
    console.print(table)
    return rows


def parse_size(text: str) -> tuple[int, int]:
    w, _, h = text.lower().partition("x")
    return int(w), int(h)


@click.command()
@click.option("--model", default="tiny", show_default=True, help="The model the replicas serve.")
@click.option("--size", default="512x512", show_default=True, help="WIDTHxHEIGHT")
@click.option("--frames", default=17, show_default=True)
@click.option("--steps", default=64, show_default=True)
@click.option("--replicas", "n", default=2, show_default=True, help="N: side (a) is N x 1, side (b) N/K x K.")
@click.option("--layout", "layouts", multiple=True, default=("ulysses:2",), show_default=True,
              help="REPLICADP_PARALLEL of side (b) and (c), K ranks each; repeat for several.")
@click.option("--requests", default=6, show_default=True, help="Measured requests per throughput run.")
@click.option("--latency-requests", default=3, show_default=True, help="Measured requests per latency run.")
@click.option("--warmup", default=2, show_default=True)
@click.option("--threads", default=1, show_default=True, help="CPU threads per process (per rank).")
@click.option("--devices", default="cpu", show_default=True,
              help="cpu, or N GPU ids (0,1): side (a) one replica per GPU, (b) one per K of them.")
@click.option("--model-only", is_flag=True, help="Print the H200 model only; run nothing.")
@click.option("--model-arch", default="wan2.2-t2v-a14b", show_default=True)
@click.option("--gpus", default=8, show_default=True)
@click.option("--json", "json_out", is_flag=True, help="Print the report as JSON on stdout.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), help="Write the report as JSON here.")
def main(model, size, frames, steps, n, layouts, requests, latency_requests, warmup, threads, devices, model_only,
         model_arch, gpus, json_out, out):
    console = Console(width=150, stderr=json_out)
    models = {f"{w}x{h}x{f}": print_model(console, model_arch, (w, h), f, 30, gpus)
              for w, h, f in ((832, 480, 33), (1280, 720, 81))}
    report = {"model_h200": {"arch": model_arch, "gpus": gpus, "peak_tflops": PEAK_TFLOPS,
                             "nvlink_gbps_assumed": NVLINK_GBPS, "steps": 30, "rows": models}}
    if not model_only:
        from replicadp_tasks.model import Layout

        sizes = {text: Layout.parse(text).size for text in layouts}
        if any(k < 2 or n % k for k in sizes.values()):
            raise click.BadParameter(f"each layout's ranks must divide N={n} (side b is N/K x K)",
                                     param_hint="--layout")
        started = time.time()
        work = Path(tempfile.mkdtemp(prefix="bench-parallel-out-"))
        baseline = work / "baseline.json"
        common = dict(size=size, frames=frames, steps=steps, baseline=baseline)
        try:
            with deployment(n, "none", threads, model, devices) as env:
                a = bench(env, work, "a", concurrency=n, requests=requests, warmup=warmup, write=True, **common)
            with deployment(1, "none", threads, model, devices) as env:
                c1 = bench(env, work, "one", concurrency=1, requests=latency_requests, warmup=1, write=False,
                           **common)
            rows = [summary(a, f"{n} x 1", "none", None), summary(c1, "1 x 1", "none", frame_diffs(work, "one", "a"))]
            for i, (text, k) in enumerate(sizes.items()):
                with deployment(n // k, text, threads, model, devices) as env:
                    b = bench(env, work, f"b{i}", concurrency=n, requests=requests, warmup=warmup, write=False,
                              **common)
                with deployment(1, text, threads, model, devices) as env:
                    c = bench(env, work, f"c{i}", concurrency=1, requests=latency_requests, warmup=1, write=False,
                              **common)
                rows += [summary(b, f"{n // k} x {k}", text, frame_diffs(work, f"b{i}", "a")),
                         summary(c, f"1 x {k}", text, frame_diffs(work, f"c{i}", "a"))]
        finally:
            shutil.rmtree(work, ignore_errors=True)
        w, h = parse_size(size)
        report |= {"model": model, "machine": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                   "size": size, "frames": frames, "steps": steps, "threads_per_process": threads,
                   "devices": devices, "requests": requests, "latency_requests": latency_requests, "warmup": warmup,
                   "seconds": round(time.time() - started, 1), "rows": rows}
        table = Table(title=f"{model}, {size}x{frames}, {steps} steps, {threads} thread per process, "
                            f"{os.cpu_count()} cores; frames against {n} x 1's")
        for col in ("replicas x K", "REPLICADP_PARALLEL", "in flight", "requests", "latency p50 s", "DiT p50 s",
                    "videos/min", "frames bitwise =", "decoded max abs / min PSNR dB"):
            table.add_column(col, justify="left" if col in ("replicas x K", "REPLICADP_PARALLEL") else "right")
        for r in rows:
            d = r["decoded"]
            diff = "-" if d is None else ("0 / identical" if d["max_abs"] == 0
                                          else f"{d['max_abs']} / {d['psnr_db_min']:.1f}")
            same = "baseline" if r["frames_identical"] is None else f"{r['frames_identical']}/{r['completed']}" + (
                f" ({r['frames_tolerated']} >= {TOLERANCE_PSNR:g} dB)" if r["frames_tolerated"] else "")
            table.add_row(r["layout"], r["parallel"], str(r["concurrency"]), f"{r['completed']} ({r['failed']} failed)",
                          f"{r['latency_p50_s']:.2f}", f"{r['dit_p50_s']:.2f}", f"{r['videos_per_min']:.1f}", same,
                          diff)
        console.print(table)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1, default=float))
    if json_out:
        print(json.dumps(report, indent=1, default=float))


if __name__ == "__main__":
    main()
