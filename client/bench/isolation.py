"""The isolation check: a baseline records each input's output (made with one replica, one request at a time);
a check replays the same inputs under concurrency and compares them, input by input (`bench --write-baseline`,
`--check-baseline`, and the demo).

A baseline is replicadp's (both hashes and the MP4 of each input, for the PSNR of a mismatch) or vllm-omni's
(`bench_replica_dp.py`'s manifest: input key -> MD5 of the MP4), read and written alike, so that a baseline made
by either tool is checked by the other.
"""

from __future__ import annotations

import hashlib
import json
import math
from enum import StrEnum
from pathlib import Path

import numpy as np

from replicadp_tasks.contract import input_key
from replicadp_tasks.outputs import decode_mp4

from ..api import Outcome, fetch_video


class BaselineFormat(StrEnum):
    """What a baseline file holds (`bench --baseline-format`); a check tells them apart by their shape."""

    REPLICADP = "replicadp"  # {"version": 2, "entries": {input_key: {hashes, params, video, ...}}}
    VLLM_OMNI = "vllm-omni"  # {"PROMPT\x1fSEED\x1fWxH\x1fFRAMES\x1fSTEPS": MP4 md5}, bench_replica_dp.py's


VLLM_OMNI_SEPARATOR = "\x1f"  # between the parts of a vllm-omni input key


class BaselineError(Exception):
    """Raised when a baseline file is neither replicadp's nor vllm-omni's, or cannot be read."""


def read_baseline(path: Path) -> tuple[BaselineFormat, dict]:
    """The baseline's format and its entries (replicadp's by input_key, or vllm-omni's key -> md5)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise BaselineError(f"{path}: cannot read it as a JSON baseline ({exc})") from None
    if isinstance(data, dict) and isinstance(data.get("entries"), dict):
        return BaselineFormat.REPLICADP, data["entries"]
    if isinstance(data, dict) and all(isinstance(v, str) and len(k.split(VLLM_OMNI_SEPARATOR)) == 5
                                      for k, v in data.items()):
        return BaselineFormat.VLLM_OMNI, data
    raise BaselineError(f"{path}: neither replicadp's baseline (version and entries) nor vllm-omni's "
                        "(input key -> MP4 md5)")


def vllm_omni_key(request: dict) -> str:
    """bench_replica_dp.py's identity of an input: prompt, seed, size (WIDTHxHEIGHT), frames and steps, joined
    by the unit separator. It has no quality nor negative prompt: both must be the same in the two runs."""
    return VLLM_OMNI_SEPARATOR.join([request["prompt"], str(request["seed"]),
                                     f"{request['width']}x{request['height']}", str(request["num_frames"]),
                                     str(request["num_inference_steps"])])


def mp4_md5(result) -> str:
    return hashlib.md5(fetch_video(result)).hexdigest()  # noqa: S324 (vllm-omni's identity of a video, not security)


def baseline_videos(path: Path) -> Path:
    """Where a baseline keeps its inputs' MP4s, for the PSNR of a mismatch: `NAME.videos/` beside `NAME.json`."""
    return path.with_name(path.stem + ".videos")


def write_baseline(path: Path, outcomes: list[Outcome], fmt: BaselineFormat = BaselineFormat.REPLICADP) -> dict:
    """Record each input's output identity, and (replicadp's format) its MP4. Returns the counts; a failed request
    is not recorded."""
    if fmt == BaselineFormat.VLLM_OMNI:  # as bench_replica_dp.py writes it
        got = {vllm_omni_key(o.request): mp4_md5(o.result) for o in outcomes if o.ok}
        path.write_text(json.dumps(got, indent=2))
        return {"format": fmt.value, "recorded": len(got), "failed": len(outcomes) - len(got)}
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
            "served": o.result.get("served") or {}, "video": f"{videos.name}/{key}.mp4",
        }
    path.write_text(json.dumps({"version": 2, "entries": entries}, indent=1, sort_keys=True))
    return {"format": fmt.value, "recorded": len(entries), "failed": len(outcomes) - len(entries)}


def layout_free_key(params: dict, model: str, served: dict) -> str:
    """An input's key as a deployment of one process would have it: a replica over several ranks
    (REPLICADP_PARALLEL) puts its layout in the input's identity, as its rounding may differ, not its input."""
    return input_key(params, model, {k: v for k, v in served.items() if k != "parallel"})


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
    fmt, entries = read_baseline(path)
    if fmt == BaselineFormat.VLLM_OMNI:
        return check_vllm_omni_baseline(entries, outcomes)
    counts = {"matched": 0, "tolerated": 0, "mismatched": 0, "unknown": 0, "unverified": 0}
    mismatches = []
    # Across layouts (a baseline of one process, a run over two ranks, or the other way): the same input.
    by_input = {layout_free_key(e["params"], e["model"], e.get("served") or {}): k for k, e in entries.items()}
    for o in outcomes:
        if not o.ok:
            counts["unverified"] += 1  # no output to compare: the request failed
            continue
        key = o.result["input_key"]
        if key not in entries:
            key = by_input.get(layout_free_key(o.result["params"], o.result["model"], o.result.get("served") or {}),
                               key)
        base = entries.get(key)
        if base is None:
            counts["unknown"] += 1  # an input the baseline never saw
            continue
        differ = [k for k in ("frames_sha256", "video_sha256") if base[k] != o.result[k]]
        if not differ:
            counts["matched"] += 1
            continue
        own_db, other_db, other = closeness(path, entries, key, decode_mp4(fetch_video(o.result)))
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
    return {"format": fmt.value, **counts, "passed": passed, "tolerance_psnr_db": tolerance_psnr,
            "mismatches": mismatches}


def check_vllm_omni_baseline(baseline: dict[str, str], outcomes: list[Outcome]) -> dict:
    """bench_replica_dp.py's check, by its rules: each output's MP4 md5 against its input's; an output the
    baseline lacks is unknown, a baseline input without an output in this run (failed, or not run) unverified.
    It passes when all of the baseline was reproduced and nothing else ran. Its baseline keeps no videos: a
    mismatch cannot be told noise or bleed (no PSNR, no tolerance)."""
    counts = {"matched": 0, "tolerated": 0, "mismatched": 0, "unknown": 0, "unverified": 0}
    mismatches, got = [], set()
    for o in outcomes:
        if not o.ok:
            continue
        key = vllm_omni_key(o.request)
        got.add(key)
        if key not in baseline:
            counts["unknown"] += 1
        elif baseline[key] == mp4_md5(o.result):
            counts["matched"] += 1
        else:
            counts["mismatched"] += 1
            mismatches.append({"prompt": o.request["prompt"], "seed": o.request["seed"], "differ": ["mp4_md5"],
                               "replica": o.result["replica"], "baseline_replica": None, "psnr_own_db": None,
                               "psnr_other_db": None, "closest_other": None, "closer_to": "unknown",
                               "tolerated": False})
    unverified = sorted(set(baseline) - got)
    counts["unverified"] = len(unverified)
    passed = counts["mismatched"] == counts["unknown"] == counts["unverified"] == 0 and counts["matched"] > 0
    not_verified = [{"prompt": prompt, "seed": int(seed)} for prompt, seed, *_ in
                    (key.split(VLLM_OMNI_SEPARATOR) for key in unverified)]
    return {"format": BaselineFormat.VLLM_OMNI.value, **counts, "passed": passed, "tolerance_psnr_db": None,
            "mismatches": mismatches, "not_verified": not_verified}


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
    made_by = f", baseline replica {m['baseline_replica']}" if m["baseline_replica"] else ""
    line = f"seed={m['seed']} prompt={m['prompt']!r}: {', '.join(m['differ'])} differ (replica {m['replica']}{made_by})"
    if m["closer_to"] == "unknown":
        return f"{line}; no baseline video to compare"

    def db(value):
        return "identical decoded frames" if value is None else f"{value:.1f} dB"

    other = "none of that shape" if m["closest_other"] is None else \
        f"{db(m['psnr_other_db'])} (seed {m['closest_other']['seed']})"
    reading = "numeric noise, not bleed" if m["closer_to"] == "own" else "CLOSER TO ANOTHER INPUT: bleed"
    return (f"{line}; PSNR against its own baseline {db(m['psnr_own_db'])}, against the closest other input "
            f"{other}: {reading}{' (tolerated)' if m['tolerated'] else ''}")
