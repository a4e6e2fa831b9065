"""A replica over K processes (REPLICADP_PARALLEL=ulysses:K) against K replicas of one, on the same cores: in one
run, (a) N replicas x 1 process under a closed loop of N requests in flight, (b) N/2 replicas x 2 ranks under the
same loop, (c) 1 x 1 and 1 x 2 one request at a time (single-request latency). (a) writes replicadp's isolation
baseline and the others check it, so that each input's frames are compared across layouts: bitwise (the
frames' SHA-256) and, for the decoded MP4s, max abs difference and PSNR. `--model-only` prints the model of
8 H200s as 8x1, 4x2, 2x4 instead (arithmetic, nothing run). docs/benchmarks.md section 12.

    python3 bench/parallel.py --out bench-results/parallel-cpu.json      # the tiny model on this machine's CPUs
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
from replicadp_tasks.architectures import (PEAK_TFLOPS, architecture, reference_expert_flops,  # noqa: E402
                                           video_tokens)
from replicadp_tasks.video import decode_mp4  # noqa: E402

CLI = str(ROOT / ".venv" / "bin" / "replicadp")
# The model's assumption on the link: NVLink 4 on an H200 moves 900 GB/s in both directions together, about
# 450 GB/s each way per GPU (NVIDIA's datasheet figure, not measured here; an all-to-all reaches less).
NVLINK_GBPS = 450.0


@contextlib.contextmanager
def deployment(replicas: int, parallel: str, threads: int, model: str):
    """`replicadp up` of `replicas` replicas with REPLICADP_PARALLEL=`parallel`, in a state dir of its own;
    always `replicadp down` after. Yields the environment that `replicadp bench` needs to reach it."""
    state = tempfile.mkdtemp(prefix="bench-parallel-")
    env = {**os.environ, "REPLICADP_STATE_DIR": state, "REPLICADP_PARALLEL": parallel,
           "REPLICADP_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    env.pop("REDIS_URL", None)
    try:
        subprocess.run([CLI, "up", "--replicas", str(replicas), "--threads", str(threads), "--devices", "cpu",
                        "--model", model], env=env, check=True, stdout=subprocess.DEVNULL)
        yield env
    finally:
        subprocess.run([CLI, "down"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        shutil.rmtree(state, ignore_errors=True)


def bench(env: dict, work: Path, name: str, *, concurrency: int, requests: int, warmup: int, size: str,
          frames: int, steps: int, baseline: Path, write: bool) -> dict:
    """One `replicadp bench` run (its report), its MP4s saved under work/name."""
    out = work / f"{name}.json"
    subprocess.run([CLI, "bench", "--concurrency", str(concurrency), "--num-requests", str(requests),
                    "--warmup", str(warmup), "--size", size, "--num-frames", str(frames), "--steps", str(steps),
                    "--label", name, "--save-dir", str(work / name), "--json", str(out),
                    "--write-baseline" if write else "--check-baseline", str(baseline)],
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


def summary(rep: dict, layout: str, diffs: dict | None) -> dict:
    iso = rep.get("isolation", {})
    return {"layout": layout, "replicas": rep["replicas"], "concurrency": rep["config"]["concurrency"],
            "completed": rep["completed"], "failed": rep["failed"], "latency_p50_s": rep["latency_s"]["p50"],
            "dit_p50_s": rep["dit_s"]["p50"], "inference_p50_s": rep["inference_s"]["p50"],
            "videos_per_min": rep["videos_per_min"],
            "frames_identical": iso.get("matched") if "baseline" in iso else None,
            "frames_mismatched": iso.get("mismatched") if "baseline" in iso else None, "decoded": diffs}


def model_rows(arch_name: str, size: tuple[int, int], frames: int, steps: int, gpus: int) -> list[dict]:
    """8 H200s as gpus/K replicas x K ranks, from the transformer's FLOPs at PEAK_TFLOPS and Ulysses' all-to-all
    bytes over NVLINK_GBPS. Transformer only (text encoder and VAE left out), no overlap of comms and compute."""
    arch = architecture(arch_name)
    cfg = arch.transformer
    width, height = size
    experts = reference_expert_flops(arch_name, height=height, width=width, num_frames=frames, steps=steps)
    flops = sum(e["dit_flops"] for e in experts.values())
    tokens = video_tokens(cfg, height=height, width=width, num_frames=frames,
                          vae_spatial=arch.vae.get("scale_factor_spatial", 8),
                          vae_temporal=arch.vae.get("scale_factor_temporal", 4))
    hidden = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    rows = []
    for k in (1, 2, 4, 8):
        if gpus % k or cfg["num_attention_heads"] % k:
            continue
        compute = flops / k / (PEAK_TFLOPS * 1e12)
        # Per attention layer and pass: 4 all-to-alls (q, k, v in; the output back), each moving (K-1)/K of the
        # whole sequence's activations across the group; every rank sends its 1/K of that on its own links.
        a2a_bytes = tokens * hidden * 2 * (k - 1) / k
        step_bytes_per_rank = 2 * cfg["num_layers"] * 4 * a2a_bytes / k  # 2 passes a step (guidance)
        comms_step = step_bytes_per_rank / (NVLINK_GBPS * 1e9)
        latency = compute + steps * comms_step
        rows.append({"layout": f"{gpus // k}x{k}", "replicas": gpus // k, "ranks": k, "tokens": tokens,
                     "request_tflops": flops / 1e12, "compute_step_s": compute / steps,
                     "a2a_gb_per_step_per_rank": step_bytes_per_rank / 1e9, "comms_step_s": comms_step,
                     "latency_s": latency, "videos_per_min": gpus // k * 60 / latency})
    return rows


def print_model(console: Console, arch_name: str, size, frames: int, steps: int, gpus: int) -> list[dict]:
    rows = model_rows(arch_name, size, frames, steps, gpus)
    table = Table(title=f"MODEL, not a measurement: {arch_name} on {gpus} H200s, {size[0]}x{size[1]}x{frames}, "
                        f"{steps} steps, {rows[0]['tokens']} tokens, {rows[0]['request_tflops']:.0f} TFLOP/request, "
                        f"{PEAK_TFLOPS:.0f} TFLOP/s, NVLink {NVLINK_GBPS:.0f} GB/s (assumed)")
    for col in ("layout", "compute/step s", "all-to-all GB/step/rank", "comms/step s", "latency s",
                "videos/min"):
        table.add_column(col, justify="left" if col == "layout" else "right")
    for r in rows:
        table.add_row(r["layout"], f"{r['compute_step_s']:.3f}", f"{r['a2a_gb_per_step_per_rank']:.2f}",
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
@click.option("--replicas", "n", default=2, show_default=True, help="N: side (a) is N x 1, side (b) N/2 x 2.")
@click.option("--requests", default=6, show_default=True, help="Measured requests per throughput run.")
@click.option("--latency-requests", default=3, show_default=True, help="Measured requests per latency run.")
@click.option("--warmup", default=2, show_default=True)
@click.option("--threads", default=1, show_default=True, help="CPU threads per process (per rank).")
@click.option("--model-only", is_flag=True, help="Print the H200 model only; run nothing.")
@click.option("--model-arch", default="wan2.2-t2v-a14b", show_default=True)
@click.option("--gpus", default=8, show_default=True)
@click.option("--json", "json_out", is_flag=True, help="Print the report as JSON on stdout.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), help="Write the report as JSON here.")
def main(model, size, frames, steps, n, requests, latency_requests, warmup, threads, model_only, model_arch, gpus,
         json_out, out):
    console = Console(width=150, stderr=json_out)
    models = {f"{w}x{h}x{f}": print_model(console, model_arch, (w, h), f, 30, gpus)
              for w, h, f in ((832, 480, 33), (1280, 720, 81))}
    report = {"model_h200": {"arch": model_arch, "gpus": gpus, "peak_tflops": PEAK_TFLOPS,
                             "nvlink_gbps_assumed": NVLINK_GBPS, "steps": 30, "rows": models}}
    if not model_only:
        if n % 2:
            raise click.BadParameter("N must be even (side b is N/2 x 2)", param_hint="--replicas")
        started = time.time()
        work = Path(tempfile.mkdtemp(prefix="bench-parallel-out-"))
        baseline = work / "baseline.json"
        common = dict(size=size, frames=frames, steps=steps, baseline=baseline)
        try:
            with deployment(n, "none", threads, model) as env:
                a = bench(env, work, "a", concurrency=n, requests=requests, warmup=warmup, write=True, **common)
            with deployment(n // 2, "ulysses:2", threads, model) as env:
                b = bench(env, work, "b", concurrency=n, requests=requests, warmup=warmup, write=False, **common)
            with deployment(1, "none", threads, model) as env:
                c1 = bench(env, work, "c1", concurrency=1, requests=latency_requests, warmup=1, write=False,
                           **common)
            with deployment(1, "ulysses:2", threads, model) as env:
                c2 = bench(env, work, "c2", concurrency=1, requests=latency_requests, warmup=1, write=False,
                           **common)
            rows = [summary(a, f"{n} x 1", None), summary(b, f"{n // 2} x 2", frame_diffs(work, "b", "a")),
                    summary(c1, "1 x 1", frame_diffs(work, "c1", "a")),
                    summary(c2, "1 x 2", frame_diffs(work, "c2", "a"))]
        finally:
            shutil.rmtree(work, ignore_errors=True)
        w, h = parse_size(size)
        report |= {"model": model, "machine": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                   "size": size, "frames": frames, "steps": steps, "threads_per_process": threads,
                   "requests": requests, "latency_requests": latency_requests, "warmup": warmup,
                   "seconds": round(time.time() - started, 1), "rows": rows}
        table = Table(title=f"{model}, {size}x{frames}, {steps} steps, {threads} thread per process, "
                            f"{os.cpu_count()} cores; frames against {n} x 1's")
        for col in ("layout", "in flight", "requests", "latency p50 s", "DiT p50 s", "videos/min",
                    "frames bitwise =", "decoded max abs / min PSNR dB"):
            table.add_column(col, justify="left" if col == "layout" else "right")
        for r in rows:
            d = r["decoded"]
            diff = "-" if d is None else ("0 / identical" if d["max_abs"] == 0
                                          else f"{d['max_abs']} / {d['psnr_db_min']:.1f}")
            same = "baseline" if r["frames_identical"] is None else f"{r['frames_identical']}/{r['completed']}"
            table.add_row(r["layout"], str(r["concurrency"]), f"{r['completed']} ({r['failed']} failed)",
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
