"""Figure 3: work-conserving routing with mixed request sizes, on synthetic replicas.

Requests whose frame counts are drawn from {17, 49, 81} are all queued at once on N pulling replicas. The
makespan is compared with the lower bound max(total work / N, longest request) and with what a push-based
round-robin router (vllm-omni's) would get: request i on replica i mod N, computed from the measured durations.

    .venv/bin/python bench/mixed_sizes.py --replicas 2,4 --out bench-results/mixed.json
"""

from __future__ import annotations

import json
import random
import shutil
import sys
import tempfile
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from client.api import run_requests, use_redis  # noqa: E402
from client.cli import size_param  # noqa: E402
from client.local.embedded import EmbeddedServer  # noqa: E402
from client.local.replicas import Replicas  # noqa: E402
from client.submit import longest_first  # noqa: E402


def measure(requests, n):
    outcomes = sorted(run_requests(requests, concurrency=0, timeout=600), key=lambda o: o.index)
    assert all(o.ok for o in outcomes), [o.error for o in outcomes if not o.ok]
    makespan = max(o.finished_at for o in outcomes) - min(o.submitted_at for o in outcomes)
    durations = [o.result["timings"]["total_s"] for o in outcomes]
    bound = max(sum(durations) / n, max(durations))
    round_robin = max(sum(durations[r::n]) for r in range(n))
    return {"makespan_s": makespan, "bound_s": bound, "round_robin_s": round_robin,
            "vs_bound": makespan / bound, "round_robin_vs_bound": round_robin / bound,
            "work_s": sum(durations)}


@click.command()
@click.option("--replicas", "counts", default="2,4", show_default=True)
@click.option("--requests", default=24, show_default=True)
@click.option("--seconds", default=5.0, show_default=True, help="synthetic:SECONDS (per reference-size request).")
@click.option("--size", default="256x256", show_default=True, callback=size_param)
@click.option("--steps", default=30, show_default=True)
@click.option("--seed", default=0, show_default=True, help="Draws the frame counts.")
@click.option("--out", default="bench-results/mixed.json", show_default=True, type=click.Path(path_type=Path))
def main(counts, requests, seconds, size, steps, seed, out):
    width, height = size
    rng = random.Random(seed)
    drawn = [{"prompt": f"mixed {i}", "seed": i, "width": width, "height": height, "num_inference_steps": steps,
              "num_frames": rng.choice((17, 49, 81))} for i in range(requests)]
    console = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 160)
    rows = []
    run_dir = Path(tempfile.mkdtemp(prefix="replicadp-mixed-"))
    try:
        server = EmbeddedServer(run_dir / "redis")
        use_redis(server.start())
        try:
            for n in map(int, counts.split(",")):
                env = {"OUTPUT_DIR": str(run_dir / "outputs")}
                with Replicas(n, redis_url=server.url, model=f"synthetic:{seconds}", env=env,
                              log_path=run_dir / f"replicas-{n}.log"):
                    warm = [{**drawn[0], "request_id": f"warm-{n}-{i}", "seed": 10**6 + i} for i in range(n)]
                    measure(warm, n)  # first requests pay one-off costs (ffmpeg start-up, imports)
                    for order, reqs in (("as drawn", drawn), ("longest first", longest_first(drawn))):
                        # Fresh ids per run: the store would otherwise hand back the first run's results.
                        reqs = [{**r, "request_id": f"mixed-{n}-{order[0]}-{i}"} for i, r in enumerate(reqs)]
                        row = {"replicas": n, "order": order, **measure(reqs, n)}
                        rows.append(row)
                        console.print(f"N={n} {order}: makespan {row['makespan_s']:.2f} s, bound {row['bound_s']:.2f} s")
        finally:
            server.stop()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    t = Table(title=f"mixed sizes: {requests} requests, frames from {{17, 49, 81}} (seed {seed}), synthetic:{seconds}, "
                    f"{width}x{height}, {steps} steps")
    for col in ("replicas", "order", "makespan", "lower bound", "makespan / bound", "round-robin", "round-robin / bound"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(str(r["replicas"]), r["order"], f"{r['makespan_s']:.2f} s", f"{r['bound_s']:.2f} s",
                  f"{r['vs_bound']:.3f}", f"{r['round_robin_s']:.2f} s", f"{r['round_robin_vs_bound']:.3f}")
    console.print(t)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"frames_drawn": [r["num_frames"] for r in drawn], "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
