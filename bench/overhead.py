"""Figure 1: what replicadp costs on top of the pipeline itself.

The tiny real model at one fixed size: the same PipelineHolder called in a plain loop in one process (with the
same encode, hashing and file write a replica does), against one replica through Celery + Redis, with the same
thread count and the same inputs. Prints a table and writes JSON.

    .venv/bin/python bench/overhead.py --requests 40 --out bench-results/overhead.json
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import click
import numpy as np
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from client.api import run_requests, use_redis  # noqa: E402
from client.bench.run import BenchConfig, make_inputs  # noqa: E402
from client.cli import size_param  # noqa: E402
from client.local.embedded import EmbeddedServer  # noqa: E402
from client.local.replicas import Replicas  # noqa: E402
from replicadp_tasks.contract import Accepts, validate_request  # noqa: E402
from replicadp_tasks.model import ModelOptions, PipelineHolder  # noqa: E402
from replicadp_tasks.outputs import encode_mp4, frames_sha256  # noqa: E402
from replicadp_tasks.outputs.store import DirStore  # noqa: E402
from replicadp_tasks.settings import SETTINGS  # noqa: E402


def pct(values, q):
    return float(np.percentile(np.asarray(values), q))


def plain_loop(holder, inputs, out_dir):
    """The pipeline with no serving layer: generate, encode, hash, write, per input."""
    store = DirStore(out_dir)
    latencies, hashes = [], []
    start = time.perf_counter()
    for i, kwargs in enumerate(inputs):
        t0 = time.perf_counter()
        frames = holder.generate(validate_request(kwargs, Accepts(size_multiple=holder.size_multiple)))
        video = encode_mp4(frames, 24)
        hashes.append(frames_sha256(frames))
        store.put(f"plain-{out_dir.name}-{i}", video, {"video_sha256": hashlib.sha256(video).hexdigest()})
        latencies.append(time.perf_counter() - t0)
    return time.perf_counter() - start, latencies, hashes


def through_replicadp(inputs, concurrency):
    outcomes = sorted(run_requests(inputs, concurrency=concurrency, timeout=600), key=lambda o: o.index)
    assert all(o.ok for o in outcomes), [o.error for o in outcomes if not o.ok]
    makespan = max(o.finished_at for o in outcomes) - min(o.submitted_at for o in outcomes)
    return makespan, [o.latency_s for o in outcomes], [o.result["frames_sha256"] for o in outcomes]


@click.command()
@click.option("--requests", default=40, show_default=True)
@click.option("--size", default="128x128", show_default=True, callback=size_param)
@click.option("--num-frames", default=17, show_default=True)
@click.option("--steps", default=8, show_default=True)
@click.option("--threads", default=1, show_default=True)
@click.option("--rounds", default=3, show_default=True, help="Plain and replicadp runs alternate, to cancel drift.")
@click.option("--out", default="bench-results/overhead.json", show_default=True, type=click.Path(path_type=Path))
def main(requests, size, num_frames, steps, threads, rounds, out):
    width, height = size
    cfg = BenchConfig(width=width, height=height, num_frames=num_frames, steps=steps)
    inputs = make_inputs(cfg, requests)
    console = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 160)
    run_dir = Path(tempfile.mkdtemp(prefix="replicadp-overhead-"))
    try:
        holder = PipelineHolder(ModelOptions("tiny", model_cache=SETTINGS.model_cache, threads=threads))
        holder.load()
        holder.generate(validate_request(inputs[0], Accepts(size_multiple=holder.size_multiple)))  # warm-up
        server = EmbeddedServer(run_dir / "redis")
        use_redis(server.start())
        plain_s, rdp_s, plain_lat, rdp_lat = [], [], [], []
        try:
            env = {"OUTPUT_DIR": str(run_dir / "outputs"), "HF_HUB_OFFLINE": "1"}
            with Replicas(1, redis_url=server.url, model="tiny", threads=threads, env=env,
                          log_path=run_dir / "replicas.log"):
                through_replicadp(make_inputs(cfg, 2, 1_000_000), 1)  # warm-up
                for r in range(rounds):
                    console.print(f"round {r + 1}/{rounds}: plain loop, then replicadp (1 replica) ...")
                    seconds, latencies, plain_hashes = plain_loop(holder, inputs, run_dir / f"plain{r}")
                    plain_s.append(seconds)
                    plain_lat += latencies
                    # Throughput: two in flight, so the next request waits in the queue, as in any busy deployment.
                    seconds, _, rdp_hashes = through_replicadp(inputs, 2)
                    rdp_s.append(seconds)
                    # Latency: one at a time, so each request pays the full round trip.
                    rdp_lat += through_replicadp(inputs, 1)[1]
        finally:
            server.stop()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    # Each round's plain and replicadp runs are a minute apart at most: their ratio cancels this VM's slow drift.
    round_ratios = [p / r for p, r in zip(plain_s, rdp_s)]
    plain_s, rdp_s = float(np.median(plain_s)), float(np.median(rdp_s))
    report = {
        "workload": {"size": f"{width}x{height}", "num_frames": num_frames, "steps": steps, "requests": requests, "threads": threads,
                     "rounds": rounds},
        "plain_videos_per_min": 60 * requests / plain_s, "replicadp_videos_per_min": 60 * requests / rdp_s,
        "throughput_ratio": plain_s / rdp_s,
        "throughput_ratio_per_round": round_ratios,
        "plain_latency_s": {"p50": pct(plain_lat, 50), "p99": pct(plain_lat, 99)},
        "replicadp_latency_s": {"p50": pct(rdp_lat, 50), "p99": pct(rdp_lat, 99)},
        "added_latency_ms": {"p50": 1000 * (pct(rdp_lat, 50) - pct(plain_lat, 50)),
                             "p99": 1000 * (pct(rdp_lat, 99) - pct(plain_lat, 99))},
        "same_frames": plain_hashes == rdp_hashes,
    }
    t = Table(title=f"overhead: tiny model {width}x{height}, {num_frames} frames, {steps} steps, {requests} requests x "
                    f"{rounds} rounds (median), {threads} thread(s)")
    for col in ("", "videos/min", "latency p50", "latency p99"):
        t.add_column(col, justify="right")
    t.add_row("plain loop", f"{report['plain_videos_per_min']:.1f}", f"{report['plain_latency_s']['p50']:.3f} s",
              f"{report['plain_latency_s']['p99']:.3f} s")
    t.add_row("replicadp (1 replica)", f"{report['replicadp_videos_per_min']:.1f}",
              f"{report['replicadp_latency_s']['p50']:.3f} s", f"{report['replicadp_latency_s']['p99']:.3f} s")
    console.print(t)
    console.print(f"throughput ratio {report['throughput_ratio']:.3f} (per round: "
                  f"{', '.join(f'{x:.3f}' for x in round_ratios)}); added latency p50 "
                  f"{report['added_latency_ms']['p50']:.1f} ms, p99 {report['added_latency_ms']['p99']:.1f} ms; "
                  f"same frames as the plain loop: {report['same_frames']}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
