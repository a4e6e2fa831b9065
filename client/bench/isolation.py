"""The isolation check: a baseline records each input's output (made with one replica, one request at a time);
a check replays the same inputs under concurrency and compares them, input by input (`bench --write-baseline`,
`--check-baseline`, and the demo)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from replicadp_tasks.video import decode_mp4

from ..api import Outcome, fetch_video


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
