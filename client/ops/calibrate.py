"""`replicadp calibrate-mag`: MagCache's ratios measured on the served model, written where its replicas read
them (REPLICADP_MAG_RATIOS, by default a file per model in the model cache: model/step_cache.mag_ratios_file)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from replicadp_tasks.contract import validate_request
from replicadp_tasks.model import ModelOptions, PipelineHolder, calibrate_mag, mag_ratios_file
from replicadp_tasks.settings import SETTINGS

from ..bench.run import PROMPTS


def ratios_path(model: str) -> Path:
    """Where the replicas of `model` read its ratios: REPLICADP_MAG_RATIOS if set, else the model cache's file."""
    return Path(os.environ["REPLICADP_MAG_RATIOS"]) if os.environ.get("REPLICADP_MAG_RATIOS") else \
        mag_ratios_file(SETTINGS.model_cache, model)


def calibrate(model: str, *, width: int, height: int, num_frames: int, steps: int, prompts: int, out: Path) -> dict:
    """Load `model` here (on this process's GPU, else the CPU), run `prompts` requests on the exact path, and write
    the mean ratio per step to `out`. Returns what was written."""
    # The exact path of the deployment's model, without what would change its residuals (a cache, adapters, a
    # layout over several processes).
    holder = PipelineHolder(ModelOptions(model, model_cache=SETTINGS.model_cache, threads=SETTINGS.threads,
                                         attention=SETTINGS.attention, deterministic=SETTINGS.deterministic))
    holder.load()
    requests = [validate_request({"prompt": PROMPTS[i % len(PROMPTS)], "seed": i, "width": width, "height": height,
                                  "num_frames": num_frames, "num_inference_steps": steps}, holder.accepts)
                for i in range(prompts)]
    started = time.time()
    ratios = calibrate_mag(holder, requests)
    saved = {"model": model, "num_inference_steps": steps, "size": f"{width}x{height}", "num_frames": num_frames,
             "prompts": prompts, "device": holder.device, "seconds": round(time.time() - started, 2),
             "calibrated_at": int(started), "mag_ratios": ratios}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(saved, indent=1))
    tmp.replace(out)  # replicas starting meanwhile read the old file or the new one, never half of one
    return saved
