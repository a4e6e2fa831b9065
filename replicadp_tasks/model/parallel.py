"""A replica over K processes (REPLICADP_PARALLEL): sequence and CFG parallelism inside one replica, so that a
deployment chooses N replicas x K GPUs, trading throughput for latency.

One replica, K ranks. The Celery pool child is rank 0: it validates a request, hands every follower the same
inputs (a JSON line on the follower's stdin: followers wait there while idle, outside any collective), and all
ranks run the same pipeline call with the same generator. Inside it, diffusers' context parallelism splits the
video tokens over the sequence ranks (Ulysses: attention heads exchanged all-to-all; ring: key/value blocks passed
round, merged by their log-sum-exp) and gathers them back before the VAE; CFG parallelism (`GuidanceSplit`,
not in diffusers) runs a step's conditional and unconditional passes on two halves of the ranks at once. The
ranks form a mesh (cfg, ring, ulysses), rank = ((c * ring) + r) * ulysses + u. Rank 0 alone decodes, encodes and
stores; a follower stops at the latents. The followers (follower.py) are started, watched and ended by rank 0;
each one dies with it (PDEATHSIG).

Any failure of the group (a follower that dies, a collective past REPLICADP_PARALLEL_TIMEOUT, an error on a rank
mid-request) ends the replica's attempt as a killed process does: the request is requeued and the pool's next
child rebuilds the group. Out of memory on a rank fails the request instead (it would fail again), and the group
is rebuilt before the next one. A cancel is agreed at each step boundary, so that every rank leaves the call
together.

Imports no Celery; torch is imported inside the functions.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, replace
from datetime import timedelta
from pathlib import Path
from typing import Callable, TypedDict

from ..contract.errors import GroupLost
from ..contract.request import GenerateRequest, Quality
from .layout import Layout

log = logging.getLogger("replicadp")

# The environment a follower reads its place and rank 0's model options from (follower.py), and the pipe it reports
# on before it exits.
RANK_ENV, WORLD_ENV, STORE_ENV, PARENT_ENV = ("REPLICADP_RANK", "REPLICADP_WORLD_SIZE", "REPLICADP_PARALLEL_STORE",
                                               "REPLICADP_PARALLEL_PARENT")
OPTIONS_ENV = "REPLICADP_PARALLEL_OPTIONS"
REPORT_FD_ENV = "REPLICADP_PARALLEL_REPORT_FD"


class Stopped(Exception):
    """Raised on a follower when rank 0 stopped the request at a step boundary (a cancel): back to waiting."""


STORE_PREFIX = "replicadp-group-"


def new_store() -> str:
    """A path for the group's rendezvous file (torch's FileStore), one per replica and start: the ranks meet through
    a file, so no rendezvous port listens anywhere. In the temp folder, named by rank 0's pid; Followers.close
    removes it, and here the files of rank 0s that are gone (killed before they could) are removed first."""
    for old in Path(tempfile.gettempdir()).glob(f"{STORE_PREFIX}*-*"):
        pid = old.name[len(STORE_PREFIX):].split("-")[0]
        if pid.isdigit() and not alive(int(pid)):
            old.unlink(missing_ok=True)
    fd, path = tempfile.mkstemp(prefix=f"{STORE_PREFIX}{os.getpid()}-")
    os.close(fd)
    os.unlink(path)  # FileStore creates it; a file left from another group would mix two rendezvous
    return path


def alive(pid: int) -> bool:
    """Whether process `pid` exists (another user's too). For a child of the caller, whose pid is not reused
    before it is reaped, that is whether it runs."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def join(rank: int, layout: Layout, store_path: str, device: str, timeout_s: float, form_timeout_s: float) -> None:
    """Join this replica's process group (gloo on the CPU, NCCL on CUDA) through its rendezvous file: each rank
    waits up to `form_timeout_s` for the others to arrive (a follower starts a Python and imports torch and
    diffusers first: seconds on a busy machine), then up to `timeout_s` in each collective. The ranks talk over
    the loopback only (they are one host's processes), whatever the host name resolves to."""
    import torch.distributed as dist

    os.environ.setdefault("NCCL_SOCKET_IFNAME" if device.startswith("cuda") else "GLOO_SOCKET_IFNAME", "lo")
    store = dist.FileStore(store_path, layout.size)
    # Every rank here before any connects: the backends' own connecting waits only `timeout_s`.
    store.set(f"replicadp-rank-{rank}", "1")
    store.wait([f"replicadp-rank-{r}" for r in range(layout.size)], timedelta(seconds=form_timeout_s))
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", store=store, rank=rank,
                            world_size=layout.size, timeout=timedelta(seconds=timeout_s))


def enable(transformers: list, layout: Layout, device: str) -> "GuidanceSplit | None":
    """Split each expert's passes over the group: the mesh (cfg, ring, ulysses); diffusers' context parallelism
    over its ring x ulysses part (Wan's own `_cp_plan`), and the guidance split over its cfg part. Returns the
    split (None without cfg), whose `negative` the caller sets per request."""
    import torch
    from diffusers import ContextParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cuda" if device.startswith("cuda") else "cpu", (layout.cfg, layout.ring, layout.ulysses),
                            mesh_dim_names=("cfg", "ring", "ulysses"))
    if layout.ring > 1 and not device.startswith("cuda"):
        _native_attention_returns_lse()
    # diffusers picks the rank's device as `rank % torch.accelerator.device_count()`, which is 0 on a CPU-only
    # torch (ZeroDivisionError); the CPU has one device for every rank.
    counts = torch.accelerator.device_count
    if not torch.cuda.is_available():
        torch.accelerator.device_count = lambda: 1
    try:
        if layout.sequence > 1:
            for transformer in transformers:
                transformer.enable_parallelism(config=ContextParallelConfig(
                    ring_degree=layout.ring, ulysses_degree=layout.ulysses, mesh=mesh["ring", "ulysses"]))
    finally:
        torch.accelerator.device_count = counts
    if layout.cfg == 1:
        return None
    split = GuidanceSplit(mesh["cfg"].get_group(), mesh.get_local_rank("cfg"))
    for transformer in transformers:
        split.install(transformer)
    return split


def _native_attention_returns_lse() -> None:
    """Ring on the CPU: diffusers' native backend refuses to return the log-sum-exp that ring merges its blocks
    by (the CUDA backends that return it do not run on the CPU); torch's CPU flash kernel returns it. Once per
    process, for attention without a mask (the video tokens' self-attention, the only one ring splits)."""
    import torch
    from diffusers.models import attention_dispatch

    native = attention_dispatch._native_attention_forward_op
    if getattr(native, "returns_lse", False):
        return

    def forward_op(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False, return_lse=False, _save_ctx=True, _parallel_config=None):
        if not return_lse or query.device.type != "cpu" or attn_mask is not None or enable_gqa:
            return native(ctx, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
                          _save_ctx, _parallel_config)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            *(x.transpose(1, 2).contiguous() for x in (query, key, value)), dropout_p, is_causal, scale=scale)
        # The model's layout, as diffusers' other backends return them: out (B, S, H, D), lse (B, S, H).
        return out.transpose(1, 2).contiguous(), lse.transpose(1, 2).contiguous()

    forward_op.returns_lse = True
    attention_dispatch._native_attention_forward_op = forward_op


class GuidanceSplit:
    """cfg:2: a step's two passes at once, on two halves of the ranks. The pipeline calls the transformer twice a
    step, conditional then unconditional; at the first call, the cfg rank 0 runs the conditional pass and the cfg
    rank 1 the unconditional one (the negative prompt's embeddings in place of the prompt's), they exchange
    their outputs, and the second call returns the unconditional output without computing it. Each pass is the
    one a single process would run, so the frames are too. `negative` is set per request: the negative prompt's
    embeddings, or None where the request runs without guidance (one pass a step, computed on every rank)."""

    def __init__(self, group, cfg_rank: int):
        self.group = group
        self.cfg_rank = cfg_rank
        self.negative = None
        self.pending = None  # the unconditional output, between a step's two calls

    def install(self, transformer) -> None:
        from diffusers.hooks import HookRegistry, ModelHook

        split = self

        class Hook(ModelHook):
            def new_forward(self, module, *args, **kwargs):
                return split.forward(self.fn_ref.original_forward, args, kwargs)

        HookRegistry.check_if_exists_or_initialize(transformer).register_hook(Hook(), "replicadp_guidance_split")

    def forward(self, forward, args: tuple, kwargs: dict):
        import torch
        import torch.distributed as dist

        if self.negative is None:
            return forward(*args, **kwargs)
        if args:  # Wan's pipelines pass every input by name; a positional call would be read wrong below
            raise TypeError("the guidance split takes the transformer's inputs by name only")
        if self.pending is not None:  # the unconditional call: computed at the conditional one
            out, self.pending = self.pending, None
            return (out,)
        if self.cfg_rank == 1:
            kwargs = {**kwargs, "encoder_hidden_states": self.negative.to(kwargs["encoder_hidden_states"].dtype)}
        mine = forward(**kwargs)[0].contiguous()
        both = [torch.empty_like(mine) for _ in range(2)]
        dist.all_gather(both, mine, group=self.group)
        self.pending = both[1]
        return (both[0],)

    def reset(self) -> None:
        """After each request, also one that failed half-way: nothing carries over to the next."""
        self.negative = self.pending = None


def agree(stop: bool, device: str) -> bool:
    """At a step boundary, on every rank: whether any rank stops here (rank 0 on a cancel)."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([int(stop)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


class Report(TypedDict):
    """What a follower tells rank 0 as it exits after a failed request (one JSON object on its report pipe)."""

    out_of_memory: str  # the rank and the allocator's message: the request fails, it is not requeued


class Work(TypedDict):
    """What rank 0 hands each follower for one request: the validated inputs, the first frame as PNG, and the
    checkpoint it goes on from where it was preempted (every rank resumes from rank 0's: after each step all
    ranks hold the same latents)."""

    request: dict  # contract.request.GenerateRequest's fields (its webhook left out: rank 0 tells its events)
    image_png: str | None  # base64
    checkpoint: str | None  # base64 of checkpoint.Checkpoint.to_bytes()


def encode_work(req, image, resume=None) -> str:
    png = None
    if image is not None:
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        png = base64.b64encode(buf.getvalue()).decode()
    checkpoint = None if resume is None else base64.b64encode(resume.to_bytes()).decode()
    return json.dumps(Work(request=asdict(replace(req, webhook=None)), image_png=png, checkpoint=checkpoint)) + "\n"


def decode_work(line: str):
    """(GenerateRequest, PIL image or None, Checkpoint or None) from a Work line."""
    from PIL import Image

    from .checkpoint import Checkpoint

    work: Work = json.loads(line)
    fields = work["request"]
    req = GenerateRequest(**{**fields, "quality": Quality(fields["quality"]),
                             "loras": tuple((name, scale) for name, scale in fields["loras"])})
    image = None if work["image_png"] is None else Image.open(io.BytesIO(base64.b64decode(work["image_png"])))
    resume = None if work["checkpoint"] is None else Checkpoint.from_bytes(base64.b64decode(work["checkpoint"]))
    return req, image, resume


class Followers:
    """Rank 0's followers: ranks 1..K-1 as `python -m replicadp_tasks.model.follower` processes, with this process's
    environment, rank 0's model options (`options`, model/options.ModelOptions), their place in the group and a
    pipe each to report on. A watcher thread
    notes a follower's exit (`lost`, and `oom` where it reported running out of memory) and calls `on_lost` once
    for any other exit: a request in flight cannot finish, and none may start on the broken group. An out of
    memory is left to the request that met it (PipelineHolder.generate fails it)."""

    def __init__(self, options, store_path: str, on_lost: Callable[[str], None] | None):
        layout = options.layout
        self.store_path = store_path
        self.lost: str | None = None
        self.oom: str | None = None
        self.closing = False
        self.procs = []
        self.reports = []
        env = {**os.environ, WORLD_ENV: str(layout.size), STORE_ENV: store_path, PARENT_ENV: str(os.getpid()),
               OPTIONS_ENV: options.to_json()}
        for rank in range(1, layout.size):
            read, write = os.pipe()
            self.procs.append(subprocess.Popen([sys.executable, "-m", "replicadp_tasks.model.follower"],
                                               env={**env, RANK_ENV: str(rank), REPORT_FD_ENV: str(write)},
                                               stdin=subprocess.PIPE, text=True, pass_fds=(write,)))
            os.close(write)
            self.reports.append(os.fdopen(read))
        self._on_lost = on_lost
        threading.Thread(target=self._watch, name="replicadp-followers", daemon=True).start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _watch(self) -> None:
        while self.lost is None and not self.closing:
            for rank, proc in enumerate(self.procs, start=1):
                if proc.poll() is not None and not self.closing:
                    text = self.reports[rank - 1].read()  # the follower has exited: its end of the pipe is closed
                    self.oom = json.loads(text)["out_of_memory"] if text else None
                    self.lost = f"follower rank {rank} (pid {proc.pid}) exited with status {proc.returncode}"
                    log.error("replica group lost: %s%s", self.lost, f" ({self.oom})" if self.oom else "")
                    if self._on_lost is not None and self.oom is None:
                        self._on_lost(self.lost)
                    return
            time.sleep(0.2)

    def out_of_memory(self, wait_s: float = 5.0) -> str | None:
        """After a call that failed on rank 0: the out of memory a follower reported as it exited, if one did;
        waits up to `wait_s` for the watcher to see the exit (a collective fails as soon as a peer is gone)."""
        deadline = time.monotonic() + wait_s
        while self.lost is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.oom

    def send(self, req, image, resume=None) -> None:
        """Hand every follower the request (and the checkpoint it goes on from); GroupLost if one of them is
        gone."""
        line = encode_work(req, image, resume)
        for rank, proc in enumerate(self.procs, start=1):
            try:
                proc.stdin.write(line)
                proc.stdin.flush()
            except (BrokenPipeError, OSError) as exc:
                raise GroupLost(f"follower rank {rank} cannot take the request: {exc!r}") from exc

    def close(self, kill: bool = False) -> None:
        """End the followers (their stdin closes: they exit; `kill`: at once, for followers that may wait in a
        collective), then make sure of it."""
        self.closing = True
        for proc in self.procs:
            try:
                proc.stdin.close()
            except OSError:
                pass
            if kill:
                proc.kill()
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for report in self.reports:
            report.close()
        try:
            os.unlink(self.store_path)
        except FileNotFoundError:  # FileStore removes it once every rank has let go of it
            pass
