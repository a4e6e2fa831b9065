"""`replicadp demo`: the reference protocol end to end on the embedded server and the tiny model.

1 replica, one request at a time, records the baseline; 2 replicas under concurrency replay the same
inputs and must reproduce every output bit for bit, faster.
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from replicadp_tasks.settings import SETTINGS

from ..local.replicas import Replicas, scratch_run
from .run import BenchConfig, add_scaling, run_bench


@dataclass
class DemoConfig:
    num_requests: int = 24
    concurrency: int = 4
    width: int = 128
    height: int = 128
    num_frames: int = 17
    steps: int = 8
    model: str = "tiny"
    output_dir: Path = Path("outputs/demo")


class DemoFailed(Exception):
    """Raised when every request of the demo's 1-replica phase failed: there is no baseline to measure scaling
    or isolation against. The message names the phase and the first request's error."""


def run_demo(cfg: DemoConfig, log, redis_url: str | None = None) -> tuple[list[dict], dict]:
    """Returns (one report per phase, the isolation result). On `redis_url` if given, else an embedded server."""
    with ExitStack() as stack:
        run_dir, url = scratch_run(stack, "replicadp-demo-", redis_url, log)
        if cfg.model.startswith("tiny"):
            from replicadp_tasks.model import resolve_model

            log(f"tiny model: {resolve_model(cfg.model, SETTINGS.model_cache)}")
        output_dir = cfg.output_dir.resolve()
        env = {"OUTPUT_DIR": str(output_dir), "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
        baseline = run_dir / "baseline.json"
        reports = []
        for n, concurrency in ((1, 1), (2, cfg.concurrency)):
            log(f"starting {n} replica(s), 1 CPU thread each ...")
            with Replicas(n, redis_url=url, model=cfg.model, threads=1, env=env,
                          log_path=run_dir / f"replicas-{n}.log"):
                bench = BenchConfig(num_requests=cfg.num_requests, concurrency=concurrency, warmup=n,
                                    width=cfg.width, height=cfg.height, num_frames=cfg.num_frames,
                                    steps=cfg.steps, timeout=300, label=f"{n} replica(s)")
                rep = run_bench(bench, write_baseline=baseline if n == 1 else None,
                                check_baseline=baseline if n == 2 else None)
                if not reports and not rep["completed"]:
                    raise DemoFailed(f"every request of the 1-replica phase failed: {rep['errors'][0]['error']}")
                add_scaling(rep, (reports[0] if reports else rep)["videos_per_min"])
                reports.append(rep)
        return reports, {**reports[1]["isolation"], "output_dir": str(output_dir)}
