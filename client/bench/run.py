"""`replicadp bench`: vllm-omni's replica-DP benchmark on Celery, against the live replicas.

A closed loop keeps at most `concurrency` requests in flight; request i gets prompt i mod pool and seed
base_seed + i, so every input is distinct. The same run can record or check an isolation baseline (isolation.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from replicadp_tasks.contract import DEFAULTS
from replicadp_tasks.model import PEAK_TFLOPS

from ..api import Outcome, check_redis, fetch_video, model_for, run_requests
from ..progress import flight_text, progress_bar, wait_for_replicas
from . import isolation

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
    width: int = DEFAULTS["width"]  # the reference workload: generate's defaults
    height: int = DEFAULTS["height"]
    num_frames: int = DEFAULTS["num_frames"]
    steps: int = DEFAULTS["num_inference_steps"]
    quality: str = "standard"  # or "fast", or "mixed": standard and fast in turn
    loras: tuple[str, ...] = ()  # registered adapters: request i runs with lora_choices(loras)[i % 3]
    models: tuple[str, ...] = ()  # request i runs on models[i % len(models)]; none: the deployment's default
    timeout: float = 1800.0
    label: str = ""
    peak_tflops: float = PEAK_TFLOPS  # the chip's bf16 matrix throughput, for model FLOP utilisation


def lora_choices(names: tuple[str, ...]) -> list[list[dict] | None]:
    """What requests in turn run with, given registered adapters: none; the first at its default scale; the
    first at 0.5 and the second (if any) at 1.5. Nothing but none without adapters."""
    if not names:
        return [None]
    both = [{"name": names[0], "scale": 0.5}] + [{"name": name, "scale": 1.5} for name in names[1:2]]
    return [None, [{"name": names[0]}], both]


def make_inputs(cfg: BenchConfig, count: int, seed_offset: int = 0) -> list[dict]:
    qualities = ("standard", "fast") if cfg.quality == "mixed" else (cfg.quality,)
    loras = lora_choices(cfg.loras)
    inputs = [{
        "prompt": cfg.prompts[i % len(cfg.prompts)], "seed": cfg.base_seed + seed_offset + i,
        "negative_prompt": cfg.negative_prompt, "height": cfg.height, "width": cfg.width,
        "num_frames": cfg.num_frames, "num_inference_steps": cfg.steps, "quality": qualities[i % len(qualities)],
        "loras": loras[i % len(loras)], "model": cfg.models[i % len(cfg.models)] if cfg.models else None,
    } for i in range(count)]
    return [{k: v for k, v in request.items() if v is not None} for request in inputs]


def _pct(values: list[float]) -> dict:
    if not values:
        return {k: None for k in ("p50", "p90", "p99", "min", "max", "mean")}
    a = np.asarray(values)
    return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "min": float(a.min()), "max": float(a.max()),
            "mean": float(a.mean())}


def closed_loop(cfg: BenchConfig, *, replicas: int, on_update=None) -> tuple[dict, list[Outcome]]:
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
        "per_model": {model: per_model(model, outcomes, makespan) for model in models},
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


def per_model(model: str, outcomes: list[Outcome], makespan: float) -> dict:
    """One model's share of a run: its requests, its videos/min over the run's makespan, its latency and wait."""
    mine = [o for o in outcomes if o.ok and o.result["model"] == model]
    replicas = {o.result["replica"] for o in mine}
    return {"completed": len(mine), "replicas": sorted(replicas),
            "videos_per_min": 60.0 * len(mine) / makespan if makespan > 0 else 0.0,
            "latency_s": _pct([o.latency_s for o in mine]),
            "queue_wait_s": _pct([o.result["timings"]["queued_s"] for o in mine
                                  if o.result["timings"]["queued_s"] is not None])}


def add_scaling(rep: dict, base_tpm: float, base_replicas: int = 1) -> None:
    """Scaling: videos/min over the baseline's (`base_tpm` videos/min at `base_replicas`); efficiency: videos/min
    per replica over the baseline's per replica (1.0: linear). The bench, the demo and the sweep all use it."""
    rep["scaling"] = rep["videos_per_min"] / base_tpm
    rep["efficiency"] = rep["videos_per_min"] / rep["replicas"] / (base_tpm / base_replicas)


def save_videos(outcomes: list[Outcome], save_dir: Path) -> None:
    save_dir.mkdir(parents=True, exist_ok=True)
    for o in outcomes:
        if o.ok:
            (save_dir / f"{o.index:04d}_seed{o.request['seed']}.mp4").write_bytes(fetch_video(o.result))


def run_bench(cfg: BenchConfig, *, save_dir: Path | None = None,
              baseline_tpm: float | None = None, write_baseline: Path | None = None,
              baseline_format: isolation.BaselineFormat = isolation.BaselineFormat.REPLICADP,
              check_baseline: Path | None = None, tolerance_psnr: float | None = None) -> dict:
    """The bench against the live replicas, with a progress bar: checks that the deployment serves cfg.models,
    waits for a first replica of each, runs the closed loop, adds scaling against `baseline_tpm` (one replica's
    videos/min), records (in `baseline_format`) or checks (either format) an isolation baseline, saves the
    videos. Returns the report."""
    check_redis()
    live = sorted({name for model in {model_for(m) for m in cfg.models or (None,)}
                   for name in wait_for_replicas(cfg.timeout, model)})
    with progress_bar() as bar:
        task = bar.add_task(f"bench {cfg.label}".strip(), total=cfg.num_requests, flight="")

        def on_update(in_flight, finished):
            bar.update(task, advance=1 if finished else 0, flight=flight_text(in_flight))

        rep, outcomes = closed_loop(cfg, replicas=len(live), on_update=on_update)
    if baseline_tpm:
        rep["baseline_tpm"] = baseline_tpm
        add_scaling(rep, baseline_tpm)
    if write_baseline:
        rep["isolation"] = {"baseline_written": str(write_baseline),
                            **isolation.write_baseline(write_baseline, outcomes, baseline_format)}
    if check_baseline:
        rep["isolation"] = {"baseline": str(check_baseline),
                            **isolation.check_baseline(check_baseline, outcomes, tolerance_psnr)}
    if save_dir:
        save_videos(outcomes, save_dir)
    return rep
