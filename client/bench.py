"""`replicadp bench`: vllm-omni's replica-DP benchmark on Celery, and the per-input isolation check.

A closed loop keeps at most `concurrency` requests in flight; request i gets prompt i mod pool and seed
base_seed + i, so every input is distinct. Isolation: a baseline records each input's output hashes (made
with one replica, one request at a time); a check replays the inputs under concurrency and compares.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from replicadp_tasks.architectures import PEAK_TFLOPS

from .api import Outcome, fetch_video, run_requests

PROMPTS = (
    "A red fox trotting through fresh snow in a pine forest at dawn, cinematic lighting",
    "A busy city street at night in the rain, neon reflections on wet asphalt",
    "A humpback whale breaching in slow motion under a cloudy sky",
    "A close-up of a hummingbird hovering beside a purple flower",
    "A steam train crossing a stone viaduct in the mountains, aerial shot",
    "A chef tossing vegetables in a flaming wok, warm kitchen light",
    "Waves crashing on black volcanic rocks, long exposure style",
    "A paper boat drifting down a rain gutter, macro lens",
)
WARMUP_SEED_OFFSET = 1_000_000  # warm-up inputs never collide with measured ones


@dataclass
class BenchConfig:
    num_requests: int = 16
    concurrency: int = 4
    warmup: int = -1
    base_seed: int = 42
    prompts: tuple[str, ...] = PROMPTS
    negative_prompt: str = ""
    width: int = 832
    height: int = 480
    num_frames: int = 33
    steps: int = 30
    timeout: float = 1800.0
    label: str = ""
    peak_tflops: float = PEAK_TFLOPS  # the chip's bf16 matrix throughput, for model FLOP utilisation


def make_inputs(cfg: BenchConfig, count: int, seed_offset: int = 0) -> list[dict]:
    return [{
        "prompt": cfg.prompts[i % len(cfg.prompts)], "seed": cfg.base_seed + seed_offset + i,
        "negative_prompt": cfg.negative_prompt, "height": cfg.height, "width": cfg.width,
        "num_frames": cfg.num_frames, "num_inference_steps": cfg.steps,
    } for i in range(count)]


def _pct(values: list[float]) -> dict:
    if not values:
        return {k: None for k in ("p50", "p90", "p99", "min", "max", "mean")}
    a = np.asarray(values)
    return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "min": float(a.min()), "max": float(a.max()),
            "mean": float(a.mean())}


def run(cfg: BenchConfig, *, replicas: int, on_update=None) -> tuple[dict, list[Outcome]]:
    """Warm up, run the timed closed loop, return (report, outcomes in input order)."""
    warmup = cfg.concurrency if cfg.warmup < 0 else cfg.warmup
    if warmup:
        for _ in run_requests(make_inputs(cfg, warmup, WARMUP_SEED_OFFSET), cfg.concurrency, cfg.timeout):
            pass
    outcomes = sorted(run_requests(make_inputs(cfg, cfg.num_requests), cfg.concurrency, cfg.timeout, on_update),
                      key=lambda o: o.index)
    return report(cfg, outcomes, replicas=replicas, warmup=warmup), outcomes


def report(cfg: BenchConfig, outcomes: list[Outcome], *, replicas: int, warmup: int) -> dict:
    ok = [o for o in outcomes if o.ok]
    start = min(o.submitted_at for o in outcomes)
    makespan = max(o.finished_at for o in outcomes) - start
    per_replica: dict[str, dict] = {}
    for o in ok:
        r = per_replica.setdefault(o.result["replica"], {"requests": 0, "busy_s": 0.0, "peak_memory_gib": None})
        r["requests"] += 1
        r["busy_s"] = round(r["busy_s"] + o.result["timings"]["total_s"], 4)
        if o.result.get("peak_memory_gib") is not None:
            r["peak_memory_gib"] = max(r["peak_memory_gib"] or 0.0, o.result["peak_memory_gib"])
    # The DiT's throughput over the denoising loops (text encoding and VAE decoding excluded), and its model
    # FLOP utilisation: FLOPs from the transformer's config, over time and the chip's peak.
    dit = [o.result for o in ok if o.result["timings"].get("dit_s") and o.result.get("dit_flops")]
    dit_rate = sum(r["dit_flops"] for r in dit) / sum(r["timings"]["dit_s"] for r in dit) if dit else None
    models = sorted({o.result["model"] for o in ok})
    return {
        "label": cfg.label, "model": models[0] if len(models) == 1 else models, "replicas": replicas,
        "config": {**asdict(cfg), "prompts": len(cfg.prompts), "warmup": warmup},
        "completed": len(ok), "failed": len(outcomes) - len(ok),
        "makespan_s": makespan,
        "videos_per_min": 60.0 * len(ok) / makespan if makespan > 0 else 0.0,
        "videos_per_s": len(ok) / makespan if makespan > 0 else 0.0,
        "latency_s": _pct([o.latency_s for o in ok]),
        "queue_wait_s": _pct([o.result["timings"]["queued_s"] for o in ok if o.result["timings"]["queued_s"] is not None]),
        "inference_s": _pct([o.result["timings"]["inference_s"] for o in ok]),
        "dit_s": _pct([r["timings"]["dit_s"] for r in dit]),
        "dit_tflops_per_s": dit_rate / 1e12 if dit_rate else None,
        # Against a GPU's peak only: a CPU's would be a number about nothing.
        "mfu": dit_rate / (cfg.peak_tflops * 1e12) if dit_rate and all(r["device"].startswith("cuda") for r in dit)
        else None,
        "per_replica": per_replica,
        "errors": [{"index": o.index, "seed": o.request["seed"], "error": o.error} for o in outcomes if not o.ok],
    }


def add_scaling(rep: dict, baseline_tpm: float) -> None:
    """Scaling against the one-replica throughput (videos/min), and efficiency = scaling / replicas."""
    rep["baseline_tpm"] = baseline_tpm
    rep["scaling"] = rep["videos_per_min"] / baseline_tpm
    rep["efficiency"] = rep["scaling"] / rep["replicas"]


def save_videos(outcomes: list[Outcome], save_dir: Path) -> None:
    save_dir.mkdir(parents=True, exist_ok=True)
    for o in outcomes:
        if o.ok:
            (save_dir / f"{o.index:04d}_seed{o.request['seed']}.mp4").write_bytes(fetch_video(o.result))


# --- isolation ----------------------------------------------------------------------------------------

def write_baseline(path: Path, outcomes: list[Outcome]) -> dict:
    """Record each input's output identity. Returns the counts; a failed request is not recorded."""
    entries = {o.result["input_key"]: {
        "prompt": o.request["prompt"], "seed": o.request["seed"], "params": o.result["params"],
        "model": o.result["model"], "frames_sha256": o.result["frames_sha256"],
        "video_sha256": o.result["video_sha256"], "replica": o.result["replica"],
    } for o in outcomes if o.ok}
    path.write_text(json.dumps({"version": 1, "entries": entries}, indent=1, sort_keys=True))
    return {"recorded": len(entries), "failed": len(outcomes) - len(entries)}


def check_baseline(path: Path, outcomes: list[Outcome]) -> dict:
    """Compare each replayed input with the baseline: matched / mismatched / unknown / unverified."""
    entries = json.loads(path.read_text())["entries"]
    counts = {"matched": 0, "mismatched": 0, "unknown": 0, "unverified": 0}
    mismatches = []
    for o in outcomes:
        if not o.ok:
            counts["unverified"] += 1  # no output to compare: the request failed
            continue
        base = entries.get(o.result["input_key"])
        if base is None:
            counts["unknown"] += 1  # an input the baseline never saw
            continue
        differ = [k for k in ("frames_sha256", "video_sha256") if base[k] != o.result[k]]
        if differ:
            counts["mismatched"] += 1
            mismatches.append({"prompt": o.request["prompt"], "seed": o.request["seed"], "differ": differ,
                               "replica": o.result["replica"], "baseline_replica": base["replica"]})
        else:
            counts["matched"] += 1
    passed = counts["matched"] == len(outcomes) and len(outcomes) > 0
    return {**counts, "passed": passed, "mismatches": mismatches}
