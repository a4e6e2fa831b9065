"""A replica over K processes (REPLICADP_PARALLEL): sequence parallelism inside one replica, so that a deployment
chooses N replicas x K GPUs, trading throughput for latency.

One replica, K ranks. The Celery pool child is rank 0: it validates a request, hands every follower the same
inputs (a JSON line on the follower's stdin: followers wait there while idle, outside any collective), and all
ranks run the same pipeline call with the same generator; inside it, diffusers' context parallelism (Ulysses)
splits the video tokens over the ranks and gathers them back before the VAE. Rank 0 alone encodes and stores.
The followers (follower.py) are started, watched and ended by rank 0; each one dies with it (PDEATHSIG).

Any failure of the group (a follower that dies, a collective past REPLICADP_PARALLEL_TIMEOUT, an error on a rank
mid-request) ends the replica's attempt as a killed process does: the request is requeued and the pool's next
child rebuilds the group. A cancel is agreed at each step boundary, so that every rank leaves the call together.

Imports no Celery; torch is imported inside the functions.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Callable, TypedDict

from .errors import GroupLost

log = logging.getLogger("replicadp")

KINDS = ("ulysses", "ring", "cfg")
SUPPORTED = ("ulysses",)  # ring needs an attention backend returning the log-sum-exp; cfg is not in diffusers
# The environment a follower reads its place from (follower.py).
RANK_ENV, WORLD_ENV, PORT_ENV, PARENT_ENV = ("REPLICADP_RANK", "REPLICADP_WORLD_SIZE", "REPLICADP_PARALLEL_PORT",
                                              "REPLICADP_PARALLEL_PARENT")


class Stopped(Exception):
    """Raised on a follower when rank 0 stopped the request at a step boundary (a cancel): back to waiting."""


@dataclass(frozen=True)
class Layout:
    """How a replica's ranks split each transformer pass: Ulysses (attention heads exchanged all-to-all)."""

    ulysses: int = 1
    ring: int = 1
    cfg: int = 1

    @property
    def size(self) -> int:
        return self.ulysses * self.ring * self.cfg

    def __str__(self) -> str:
        parts = [f"{kind}:{degree}" for kind, degree in asdict(self).items() if degree > 1]
        return ",".join(parts) or "none"

    @classmethod
    def parse(cls, text: str) -> "Layout":
        """`none`, or comma-separated KIND:DEGREE (ulysses:2, ulysses:2,ring:2); ValueError saying what is wrong."""
        text = text.strip().lower()
        if text in ("", "none"):
            return cls()
        degrees: dict[str, int] = {}
        for part in text.split(","):
            kind, _, degree = part.strip().partition(":")
            if kind not in KINDS:
                raise ValueError(f"{part.strip()!r}: expected KIND:DEGREE with KIND one of {', '.join(KINDS)}")
            if kind in degrees:
                raise ValueError(f"{kind} is given twice")
            if not (degree.isascii() and degree.isdigit() and int(degree) >= 1):
                raise ValueError(f"{part.strip()!r}: the degree must be a whole number of at least 1")
            degrees[kind] = int(degree)
        return cls(**degrees)


def check(layout: Layout, *, devices: list[str], device: str, options: dict[str, str]) -> None:
    """Refuse, naming REPLICADP_PARALLEL, a layout this replica cannot run: a kind not supported yet, GPUs other
    than one per rank, or a deployment option that has not run on a split transformer (`options`: setting ->
    value, the ones set away from their default). Before anything is loaded."""
    from .errors import ModelLoadError

    name = f"REPLICADP_PARALLEL={layout}"
    unsupported = [kind for kind in KINDS if getattr(layout, kind) > 1 and kind not in SUPPORTED]
    if unsupported:
        raise ModelLoadError(f"{name}: {', '.join(unsupported)} is not supported yet; supported: "
                             f"{', '.join(f'{k}:K' for k in SUPPORTED)}")
    if device == "cuda" and len(devices) != layout.size:
        raise ModelLoadError(f"{name} runs {layout.size} ranks, one per GPU, and this replica sees {len(devices)} "
                             f"GPU(s); set GPUS_PER_REPLICA={layout.size}")
    for setting, value in options.items():
        raise ModelLoadError(f"{name} cannot be combined with {setting}={value}: not supported yet; choose one")


def check_heads(layout: Layout, heads: int) -> None:
    """Refuse, naming REPLICADP_PARALLEL, a Ulysses degree that does not divide the model's attention heads."""
    from .errors import ModelLoadError

    if heads % layout.ulysses:
        raise ModelLoadError(f"REPLICADP_PARALLEL={layout}: the model's {heads} attention heads do not split over "
                             f"{layout.ulysses} ranks (Ulysses gives each rank heads / degree); choose a degree that "
                             f"divides {heads}")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now: the group's rendezvous, one per replica and start."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join(rank: int, layout: Layout, port: int, device: str, timeout_s: float) -> None:
    """Join this replica's process group (gloo on the CPU, NCCL on CUDA), rank 0 hosting its rendezvous."""
    import torch.distributed as dist

    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=layout.size, timeout=timedelta(seconds=timeout_s))


def enable(transformers: list, layout: Layout) -> None:
    """Split each expert's passes over the group (diffusers' context parallelism; Wan's own `_cp_plan`)."""
    import torch
    from diffusers import ContextParallelConfig

    # diffusers picks the rank's device as `rank % torch.accelerator.device_count()`, which is 0 on a CPU-only
    # torch (ZeroDivisionError); the CPU has one device for every rank.
    counts = torch.accelerator.device_count
    if not torch.cuda.is_available():
        torch.accelerator.device_count = lambda: 1
    try:
        for transformer in transformers:
            transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=layout.ulysses))
    finally:
        torch.accelerator.device_count = counts


def agree(stop: bool, device: str) -> bool:
    """At a step boundary, on every rank: whether any rank stops here (rank 0 on a cancel)."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([int(stop)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


class Work(TypedDict):
    """What rank 0 hands each follower for one request: the validated inputs, and the first frame as PNG."""

    request: dict  # validate.GenerateRequest's fields
    image_png: str | None  # base64


def encode_work(req, image) -> str:
    png = None
    if image is not None:
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        png = base64.b64encode(buf.getvalue()).decode()
    return json.dumps(Work(request=asdict(req), image_png=png)) + "\n"


def decode_work(line: str):
    """(GenerateRequest, PIL image or None) from a Work line."""
    from PIL import Image

    from .step_cache import Quality
    from .validate import GenerateRequest

    work: Work = json.loads(line)
    req = GenerateRequest(**{**work["request"], "quality": Quality(work["request"]["quality"])})
    image = None if work["image_png"] is None else Image.open(io.BytesIO(base64.b64decode(work["image_png"])))
    return req, image


class Followers:
    """Rank 0's followers: ranks 1..K-1 as `python -m replicadp_tasks.follower` processes, with this process's
    environment (so the same settings) and their place in the group. A watcher thread calls `on_lost` once if
    one of them exits."""

    def __init__(self, layout: Layout, port: int, on_lost: Callable[[str], None] | None):
        self.lost: str | None = None
        self.closing = False
        self.procs = []
        env = {**os.environ, WORLD_ENV: str(layout.size), PORT_ENV: str(port), PARENT_ENV: str(os.getpid())}
        for rank in range(1, layout.size):
            self.procs.append(subprocess.Popen([sys.executable, "-m", "replicadp_tasks.follower"],
                                               env={**env, RANK_ENV: str(rank)}, stdin=subprocess.PIPE, text=True))
        self._on_lost = on_lost
        threading.Thread(target=self._watch, name="replicadp-followers", daemon=True).start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _watch(self) -> None:
        while self.lost is None and not self.closing:
            for rank, proc in enumerate(self.procs, start=1):
                if proc.poll() is not None and not self.closing:
                    self.lost = f"follower rank {rank} (pid {proc.pid}) exited with status {proc.returncode}"
                    log.error("replica group lost: %s", self.lost)
                    if self._on_lost is not None:
                        self._on_lost(self.lost)
                    return
            time.sleep(0.2)

    def send(self, req, image) -> None:
        """Hand every follower the request; GroupLost if one of them is gone."""
        line = encode_work(req, image)
        for rank, proc in enumerate(self.procs, start=1):
            try:
                proc.stdin.write(line)
                proc.stdin.flush()
            except (BrokenPipeError, OSError) as exc:
                raise GroupLost(f"follower rank {rank} cannot take the request: {exc!r}") from exc

    def close(self) -> None:
        """End the followers (their stdin closes: they exit), then make sure of it."""
        self.closing = True
        for proc in self.procs:
            try:
                proc.stdin.close()
            except OSError:
                pass
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
