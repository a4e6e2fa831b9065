"""`replicadp bench`: vllm-omni's replica-DP benchmark on Celery, and the per-input isolation check.

A closed loop keeps at most `concurrency` requests in flight; request i gets prompt i mod pool and seed
base_seed + i, so every input is distinct. Isolation: a baseline records each input's output hashes (made
with one replica, one request at a time); a check replays the inputs under concurrency and compares.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from replicadp_tasks.architectures import PEAK_TFLOPS
from replicadp_tasks.video import decode_mp4

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

def baseline_videos(path: Path) -> Path:
    """Where a baseline keeps its inputs' MP4s, for the PSNR of a mismatch: `NAME.videos/` beside `NAME.json`."""
    return path.with_name(path.stem + ".videos")


def write_baseline(path: Path, outcomes: list[Outcome]) -> dict:
    """Record each input's output identity, and its MP4. Returns the counts; a failed request is not recorded."""
    videos = baseline_videos(path)
    videos.mkdir(parents=True, exist_ok=True)
    entries = {}
    for o in outcomes:
        if not o.ok:
            continue
        key = o.result["input_key"]  # a sha256: a safe file name
        (videos / f"{key}.mp4").write_bytes(fetch_video(o.result))
        entries[key] = {
            "prompt": o.request["prompt"], "seed": o.request["seed"], "params": o.result["params"],
            "model": o.result["model"], "frames_sha256": o.result["frames_sha256"],
            "video_sha256": o.result["video_sha256"], "replica": o.result["replica"],
            "video": f"{videos.name}/{key}.mp4",
        }
    path.write_text(json.dumps({"version": 2, "entries": entries}, indent=1, sort_keys=True))
    return {"recorded": len(entries), "failed": len(outcomes) - len(entries)}


def psnr_db(a: np.ndarray, b: np.ndarray) -> float:
    """Peak signal-to-noise ratio of two uint8 videos of one shape, in dB (inf when they are equal)."""
    mse = float(np.mean((a.astype(np.float32) - b.astype(np.float32)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0 ** 2 / mse)


def check_baseline(path: Path, outcomes: list[Outcome], tolerance_psnr: float | None = None) -> dict:
    """Compare each replayed input with the baseline: matched / tolerated / mismatched / unknown / unverified.

    Exact equality of both hashes is the verdict. For each mismatch, the PSNR of its decoded video against its
    own input's baseline and against the closest baseline of any other input tells numeric noise (close to its
    own) from bleed (as close to another input's). With `tolerance_psnr`, a mismatch whose PSNR against its own
    baseline is at least that many dB, and higher than against any other, counts as tolerated, not mismatched.
    """
    entries = json.loads(path.read_text())["entries"]
    counts = {"matched": 0, "tolerated": 0, "mismatched": 0, "unknown": 0, "unverified": 0}
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
        if not differ:
            counts["matched"] += 1
            continue
        own_db, other_db, other = closeness(path, entries, o.result["input_key"], decode_mp4(fetch_video(o.result)))
        closer = "unknown" if own_db is None else "own" if own_db > other_db else "other"
        tolerated = tolerance_psnr is not None and closer == "own" and own_db >= tolerance_psnr
        counts["tolerated" if tolerated else "mismatched"] += 1
        mismatches.append({
            "prompt": o.request["prompt"], "seed": o.request["seed"], "differ": differ,
            "replica": o.result["replica"], "baseline_replica": base["replica"],
            # JSON has no infinity: the PSNR of equal videos is null
            "psnr_own_db": _finite(own_db), "psnr_other_db": _finite(other_db), "closest_other": other,
            "closer_to": closer, "tolerated": tolerated,
        })
    passed = counts["matched"] + counts["tolerated"] == len(outcomes) and len(outcomes) > 0
    return {**counts, "passed": passed, "tolerance_psnr_db": tolerance_psnr, "mismatches": mismatches}


def closeness(path: Path, entries: dict, key: str, frames: np.ndarray) -> tuple[float | None, float, dict | None]:
    """PSNR of `frames` against input `key`'s baseline video (None: no such video of that shape), the
    highest PSNR against any other input's (-inf: none of that shape), and that other input."""
    def decoded(k):
        video = entries[k].get("video")  # a version 1 baseline kept no videos, a copied one may have lost them
        file = path.parent / video if video else None
        return decode_mp4(file.read_bytes()) if file is not None and file.is_file() else None

    own = decoded(key)
    if own is None or own.shape != frames.shape:
        return None, -math.inf, None
    other_db, other = -math.inf, None
    for k in entries:
        if k != key and (theirs := decoded(k)) is not None and theirs.shape == frames.shape:
            if (db := psnr_db(frames, theirs)) > other_db:
                other_db, other = db, {"prompt": entries[k]["prompt"], "seed": entries[k]["seed"]}
    return psnr_db(frames, own), other_db, other


def _finite(db: float | None) -> float | None:
    return round(db, 2) if db is not None and math.isfinite(db) else None


def verdict(iso: dict) -> str:
    """The isolation check in one line, for the bench report and the demo."""
    passed = "PASS" if iso["passed"] else "FAIL"
    tolerance = iso.get("tolerance_psnr_db")
    counts = (f"{iso['matched']} matched, {iso['mismatched']} mismatched, {iso['unknown']} unknown, "
              f"{iso['unverified']} unverified")
    if tolerance is None:
        return f"{passed}: {counts}"
    return (f"{passed} WITH TOLERANCE (--tolerance-psnr {tolerance:g} dB; not bit-exact): {counts}, "
            f"{iso['tolerated']} within the tolerance")


def describe_mismatch(m: dict) -> str:
    """One mismatch as a line: what differed, where, and how close it is to its own input and to another."""
    line = (f"seed={m['seed']} prompt={m['prompt']!r}: {', '.join(m['differ'])} differ (replica {m['replica']}, "
            f"baseline replica {m['baseline_replica']})")
    if m["closer_to"] == "unknown":
        return f"{line}; no baseline video to compare"

    def db(value):
        return "identical decoded frames" if value is None else f"{value:.1f} dB"

    other = "none of that shape" if m["closest_other"] is None else \
        f"{db(m['psnr_other_db'])} (seed {m['closest_other']['seed']})"
    reading = "numeric noise, not bleed" if m["closer_to"] == "own" else "CLOSER TO ANOTHER INPUT: bleed"
    return (f"{line}; PSNR against its own baseline {db(m['psnr_own_db'])}, against the closest other input "
            f"{other}: {reading}{' (tolerated)' if m['tolerated'] else ''}")
