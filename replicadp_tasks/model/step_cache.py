"""Step caching: the fast path a request may ask for (`quality="fast"`), and MagCache's calibration.

A step cache reuses the transformer's work of earlier denoising steps where it predicts little change (diffusers'
CacheMixin hooks on the transformer's blocks): fewer block computations, a slightly different video. Its state
lives in those hooks, and a request that ends half-way (cancelled, out of memory) leaves it there: the next
request would start from another request's activations (docs/benchmarks.md, "Step caching"). So the hooks are
installed at the start of each fast request and removed at its end: no cache state outlives its request.

Imports no Celery; torch and diffusers are imported inside the functions (the Celery main process imports this).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from ..contract.errors import ModelLoadError
from ..contract.request import Quality


class CacheMethod(StrEnum):
    """REPLICADP_CACHE: the step cache of a deployment's fast path."""

    NONE = "none"  # no fast path: requests asking for quality=fast are refused
    FIRST_BLOCK = "first-block"  # FirstBlockCache: skip the other blocks while the first block's output barely moves
    MAG = "mag"  # MagCache: skip whole steps while the calibrated residual magnitudes predict little error
    TAYLORSEER = "taylorseer"  # TaylorSeer: predict attention and feed-forward outputs between full steps
    PAB = "pab"  # Pyramid Attention Broadcast: reuse self-attention across steps in the middle of the schedule


# Each method's knob: a threshold (the change below which work is skipped) or an interval (steps between full
# computations). The defaults are diffusers'; PAB's interval is its usual self-attention skip range.
THRESHOLDS = {CacheMethod.FIRST_BLOCK: 0.05, CacheMethod.MAG: 0.06}
INTERVALS = {CacheMethod.TAYLORSEER: 5, CacheMethod.PAB: 2}
# Wan's blocks: self-attention, cross-attention and feed-forward of block i (TaylorSeer's default patterns name
# other models' modules and match none of Wan's).
WAN_BLOCK_PARTS = r"blocks\.\d+\.(attn1|attn2|ffn)"


@dataclass(frozen=True)
class StepCache:
    """A deployment's step cache, checked: the method, its knob, and MagCache's calibrated ratios."""

    method: CacheMethod
    threshold: float | None = None
    interval: int | None = None
    mag_ratios: tuple[float, ...] | None = None

    @classmethod
    def of(cls, method: CacheMethod, threshold: float | None = None, interval: int | None = None,
           mag_ratios_path: Path | None = None, model: str = "") -> "StepCache":
        """The settings checked together (ModelLoadError names the setting and what it takes); a MagCache reads
        its ratios from `mag_ratios_path`, written for `model` by `replicadp calibrate-mag`."""
        if threshold is not None and method not in THRESHOLDS:
            raise ModelLoadError(f"REPLICADP_CACHE_THRESHOLD={threshold}: REPLICADP_CACHE={method} takes no threshold "
                                 f"(only {', '.join(THRESHOLDS)} do)")
        if interval is not None and method not in INTERVALS:
            raise ModelLoadError(f"REPLICADP_CACHE_INTERVAL={interval}: REPLICADP_CACHE={method} takes no interval "
                                 f"(only {', '.join(INTERVALS)} do)")
        if threshold is not None and not 0 < threshold <= 1:
            raise ModelLoadError(f"REPLICADP_CACHE_THRESHOLD={threshold}: expected a number in (0, 1]")
        if interval is not None and not 1 <= interval <= 50:
            raise ModelLoadError(f"REPLICADP_CACHE_INTERVAL={interval}: expected an integer from 1 to 50")
        ratios = read_mag_ratios(mag_ratios_path, model) if method == CacheMethod.MAG else None
        return cls(method, threshold if threshold is not None else THRESHOLDS.get(method),
                   interval if interval is not None else INTERVALS.get(method), ratios)

    @property
    def qualities(self) -> list[str]:
        """What requests may ask for on this deployment."""
        return [Quality.STANDARD] if self.method == CacheMethod.NONE else [Quality.STANDARD, Quality.FAST]

    def __str__(self) -> str:
        """The method and its knob, e.g. `mag threshold=0.06`: what a fast result says ran, and part of its identity."""
        knob = f" threshold={self.threshold}" if self.threshold is not None else \
            f" interval={self.interval}" if self.interval is not None else ""
        return f"{self.method}{knob}"

    def config(self, steps: int, current_timestep):
        """The diffusers cache config for one request of `steps` denoising steps; `current_timestep()` gives the
        running pipeline's timestep (PAB skips by it)."""
        import torch
        from diffusers.hooks import (FirstBlockCacheConfig, MagCacheConfig, PyramidAttentionBroadcastConfig,
                                     TaylorSeerCacheConfig)

        if self.method == CacheMethod.FIRST_BLOCK:
            return FirstBlockCacheConfig(threshold=self.threshold)
        if self.method == CacheMethod.MAG:  # ratios calibrated at one step count are interpolated to `steps`
            return MagCacheConfig(threshold=self.threshold, num_inference_steps=steps, mag_ratios=list(self.mag_ratios))
        if self.method == CacheMethod.TAYLORSEER:
            # Factors in fp32: bf16 factors (diffusers' default) add their own rounding to every prediction.
            return TaylorSeerCacheConfig(cache_interval=self.interval, taylor_factors_dtype=torch.float32,
                                         cache_identifiers=[WAN_BLOCK_PARTS])
        if self.method == CacheMethod.PAB:
            return PyramidAttentionBroadcastConfig(spatial_attention_block_skip_range=self.interval,
                                                   current_timestep_callback=current_timestep)
        raise ValueError(f"no cache config for {self.method}")


def mag_ratios_file(model_cache: Path, model: str) -> Path:
    """Where `replicadp calibrate-mag` writes a model's ratios and its replicas read them, unless
    REPLICADP_MAG_RATIOS names a file: beside the models the host builds, one file per model."""
    return model_cache / "mag-ratios" / (re.sub(r"[^A-Za-z0-9_.-]+", "_", model) + ".json")


def read_mag_ratios(path: Path | None, model: str) -> tuple[float, ...]:
    """The ratios `calibrate-mag` wrote for `model` at `path`; ModelLoadError saying how to make them."""
    how = f"run `replicadp calibrate-mag --model {model}` first (it writes {path})"
    try:
        saved = json.loads(Path(path).read_text())
    except (OSError, TypeError) as exc:
        raise ModelLoadError(f"REPLICADP_CACHE=mag needs MagCache ratios calibrated on {model!r}: cannot read "
                             f"{path} ({exc}); {how}") from None
    except ValueError as exc:
        raise ModelLoadError(f"REPLICADP_MAG_RATIOS={path}: not JSON ({exc}); {how}") from None
    if not isinstance(saved, dict):
        saved = {}
    if saved.get("model") != model:
        raise ModelLoadError(f"REPLICADP_MAG_RATIOS={path}: calibrated on {saved.get('model')!r}, not on the served "
                             f"model {model!r}; {how}")
    ratios = saved.get("mag_ratios")
    if not (isinstance(ratios, list) and ratios and all(isinstance(r, (int, float)) and r > 0 for r in ratios)):
        raise ModelLoadError(f"REPLICADP_MAG_RATIOS={path}: `mag_ratios` is not a list of positive numbers; {how}")
    return tuple(float(r) for r in ratios)


def count_block_work(transformer) -> dict:
    """Count the calls of each of the transformer's blocks' self-attention, cross-attention and feed-forward (their
    first linear layer: a skipped block, attention or step calls none), for as long as the transformer lives: what
    a fast path skipped, for bench/step_cache.py and the tests. Returns the live counter, {"n": calls}."""
    calls = {"n": 0}

    def count(*_):
        calls["n"] += 1

    for block in transformer.blocks:
        for part in (block.attn1.to_q, block.attn2.to_q, block.ffn.net[0].proj):
            part.register_forward_pre_hook(count)
    return calls


def calibrate_mag(holder, requests) -> list[float]:
    """MagCache's ratios for the model `holder` (a loaded pipeline.PipelineHolder) serves, on the exact path:
    at each step, the mean over tokens of |residual| / |previous step's residual|, where the residual is what the
    transformer's blocks add to their input; averaged over `requests` (GenerateRequests of one step count).
    The formula of diffusers' own calibration mode, on the conditional pass (the first of each step's two)."""
    import torch

    blocks = holder.pipe.transformer.blocks
    steps = {r.num_inference_steps for r in requests}
    if len(steps) != 1:
        raise ValueError(f"calibration requests must share one step count, got {sorted(steps)}")
    per_request: list[list[float]] = []
    residuals: list = []
    inputs: list = []

    def before(_module, args, kwargs):
        inputs.append(kwargs.get("hidden_states", args[0] if args else None))

    def after(_module, _args, _kwargs, output):
        residuals.append((output[0] if isinstance(output, tuple) else output) - inputs[-1])

    hooks = [blocks[0].register_forward_pre_hook(before, with_kwargs=True),
             blocks[-1].register_forward_hook(after, with_kwargs=True)]
    try:
        for req in requests:
            inputs.clear()
            residuals.clear()
            holder.generate(req)
            passes = 2 if req.guidance_scale > 1.0 else 1
            cond = residuals[::passes]  # the pipeline runs the conditional pass first at every step
            ratios = [1.0]
            for prev, cur in zip(cond, cond[1:]):
                cur_norm = torch.linalg.norm(cur.float(), dim=-1)
                prev_norm = torch.linalg.norm(prev.float(), dim=-1)
                ratios.append((cur_norm / (prev_norm + 1e-8)).mean().item())
            per_request.append(ratios)
    finally:
        for hook in hooks:
            hook.remove()
    return [round(sum(column) / len(column), 6) for column in zip(*per_request)]
