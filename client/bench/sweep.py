"""`replicadp sweep`: the same bench workload at N = 1, 2, 4, ... replicas; a table, JSON, Markdown and a PNG."""

from __future__ import annotations

import json
import math
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

from ..local.replicas import Replicas, scratch_run
from .run import BenchConfig, add_scaling, run_bench


def even_request_count(requested: int, counts: list[int]) -> int:
    """The smallest multiple of every N that is >= requested: an uneven tail would hide the system's own
    overhead behind replicas idling at the end."""
    lcm = math.lcm(*counts)
    return max(lcm, -(-requested // lcm) * lcm)


def run_sweep(counts: list[int], cfg: BenchConfig, *, model: str, threads: int | None, devices: str,
              log, env: dict | None = None, redis_url: str | None = None) -> list[dict]:
    """One bench per N with a fresh set of replicas, on `redis_url` if given, else an embedded server;
    concurrency 0 means 2 x N (the queue is never empty). Scaling and efficiency are against the first N."""
    reports = []
    with ExitStack() as stack:
        run_dir, url = scratch_run(stack, "replicadp-sweep-", redis_url)
        for n in counts:
            gpu_ids = devices.split(",")
            n_devices = "cpu" if devices == "cpu" else ",".join(gpu_ids[:n])
            log(f"starting {n} replica(s) of {model!r} ...")
            with Replicas(n, redis_url=url, model=model, devices=n_devices, threads=threads, env=env,
                          log_path=run_dir / f"replicas-{n}.log"):
                step = replace(cfg, concurrency=cfg.concurrency or 2 * n, warmup=n if cfg.warmup < 0 else cfg.warmup,
                               label=f"{n} replica(s)")
                rep = run_bench(step)
                base = reports[0] if reports else rep
                add_scaling(rep, base["videos_per_min"], base["replicas"])
                reports.append(rep)
                log(f"  {n} replica(s): {rep['videos_per_min']:.2f} videos/min, efficiency "
                    f"{100 * rep['efficiency']:.1f}%, {rep['failed']} failed")
    return reports


def table_title(model: str, devices: str, threads: int | None, cfg: BenchConfig) -> str:
    """The table's and the plot's title: the workload, and where it ran."""
    if devices != "cpu":
        return f"{model} on GPUs {devices}"
    return (f"{model}, {cfg.width}x{cfg.height}, {cfg.num_frames} frames, {cfg.steps} steps, {cfg.num_requests} "
            f"requests, {threads} thread(s)/replica")


def write_outputs(reports: list[dict], out_prefix: Path, title: str) -> list[Path]:
    """`<prefix>.json`, `<prefix>.md` (the table) and `<prefix>.png` (throughput against replicas, ideal line)."""
    out_prefix.parent.mkdir(parents=True, exist_ok=True)
    paths = [out_prefix.with_suffix(".json"), out_prefix.with_suffix(".md"), out_prefix.with_suffix(".png")]
    paths[0].write_text(json.dumps(reports, indent=1))
    lines = [f"**{title}**", "", "| replicas | videos/min | scaling | efficiency | p50 latency (s) | p90 latency (s) |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in reports:
        lines.append(f"| {r['replicas']} | {r['videos_per_min']:.2f} | {r['scaling']:.2f}x | {100 * r['efficiency']:.1f}% "
                     f"| {r['latency_s']['p50']:.2f} | {r['latency_s']['p90']:.2f} |")
    paths[1].write_text("\n".join(lines) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = [r["replicas"] for r in reports]
    tpm = [r["videos_per_min"] for r in reports]
    per_replica = tpm[0] / n[0]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    ax.plot(n, [per_replica * x for x in n], "--", color="grey", label="ideal (linear)")
    ax.plot(n, tpm, "o-", label="replicadp")
    for x, y, r in zip(n, tpm, reports):
        ax.annotate(f"{100 * r['efficiency']:.1f}%", (x, y), textcoords="offset points", xytext=(4, -12), fontsize=8)
    ax.set_xlabel("replicas")
    ax.set_ylabel("videos / min")
    ax.set_xticks(n)
    ax.set_title(title, fontsize=9)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(paths[2])
    plt.close(fig)
    return paths
