"""The synthetic backend (`synthetic:SECONDS[:DECODE]`), for benchmarks and queue tests only: it computes
nothing, sleeps a request's share of SECONDS step by step (so 8 replicas fit on 2 cores) and DECODE after its last
step, and returns frames that are a function of the inputs alone: one flat colour per frame. It serves a replica as
PipelineHolder does, so that everything around the model is measured as it runs."""

from __future__ import annotations

import hashlib
import json
import time
from typing import Callable

import numpy as np

from ..contract.errors import RequestPreempted
from ..contract.request import REFERENCE_WORK, Accepts, GenerateRequest, Quality
from .checkpoint import Checkpoint
from .loading import synthetic_seconds
from .options import ModelOptions
from .pipeline import RunStats


class SyntheticBackend:
    """A stand-in for PipelineHolder: the same attributes a replica reads, a model of nothing."""

    def __init__(self, options: ModelOptions):
        self.options = options
        self.seconds, self.decode_s = synthetic_seconds(options.spec)
        self.device = "cpu (synthetic benchmark backend)"
        self.devices: list[str] = ["cpu"]
        self.accepts = Accepts(size_multiple=16, qualities=(Quality.STANDARD,), experts=1, takes_image=True,
                               loras={})
        self.adapters: list = []
        self.fused: list = []
        self.recipe = None
        self.followers = None
        self.group_broken: str | None = None
        self.last_run: RunStats | None = None

    def load(self) -> None:
        """Nothing to load."""

    def served(self, req: GenerateRequest) -> dict:
        """Nothing of the deployment changes its frames."""
        return {}

    def generate(self, req: GenerateRequest, image=None, on_step: Callable[[int, int], None] | None = None,
                 resume: Checkpoint | None = None) -> np.ndarray:
        """Sleep the request's steps (those after `resume`'s step), calling `on_step` after each, then DECODE; the
        frames of its inputs. A RequestPreempted from `on_step` comes out with a checkpoint of its step (no state:
        the frames are its inputs')."""
        steps = req.num_inference_steps
        duration = self.seconds * req.height * req.width * req.num_frames * steps / REFERENCE_WORK
        first = resume.step if resume is not None else 0
        began = time.monotonic()
        start = began - duration * first / steps
        for step in range(first + 1, steps + 1):
            # Absolute deadlines: progress reporting does not stretch the request. A step with no time left does
            # not sleep: time.sleep(0) would hand the GIL to the finisher's thread and wait to get it back.
            left = start + duration * step / steps - time.monotonic()
            if left > 0:
                time.sleep(left)
            if on_step is not None:
                try:
                    on_step(step, steps)
                except RequestPreempted as exc:
                    exc.checkpoint = Checkpoint(step, steps, latents=None, scheduler={}, devices={})
                    raise
        loop_s = time.monotonic() - began  # its denoising: what tells the page how long a decode takes after it
        time.sleep(self.decode_s)
        self.last_run = RunStats(dit_s=loop_s, dit_flops=None, peak_memory_gib=None)
        return frames_of(req, image)


def frames_of(req: GenerateRequest, image) -> np.ndarray:
    """One flat colour per frame, drawn from the hash of the request's params (not its request_id) and its first
    frame's pixels. Each frame's colour is repeated into one buffer: the cheapest way found to write them (docs/
    benchmarks.md, section 15)."""
    seed = hashlib.sha256(json.dumps(req.params(), sort_keys=True).encode())
    if image is not None:
        seed.update(image.tobytes())
    stream = b"".join(hashlib.sha256(seed.digest() + i.to_bytes(4, "big")).digest()
                      for i in range(req.num_frames * 3 // 32 + 1))
    size = req.height * req.width * 3
    frames = bytearray(req.num_frames * size)
    for i in range(req.num_frames):
        frames[i * size:(i + 1) * size] = stream[3 * i:3 * i + 3] * (req.height * req.width)
    return np.frombuffer(frames, np.uint8).reshape(req.num_frames, req.height, req.width, 3)
