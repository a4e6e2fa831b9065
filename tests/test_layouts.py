"""Layouts over several ranks (REPLICADP_PARALLEL, parallel.py) beyond Ulysses, and what any layout must survive:
each kind and two combinations against one process's frames (a pipeline holder per layout, its followers on
gloo), a replica over cfg:2,ring:2 that serves, cancels and serves the same again, out of memory on a follower and
on rank 0, and describe-model's share per rank. test_parallel.py has the setting, the refusals and a K=2
replica's life (Python, HTTP, cancel, follower faults, a one-process baseline)."""

import json
import os
import resource
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import redis

from conftest import run_client_on, start_replicas
from helpers import tiny_request_lasting, wait_for_step
from test_faults import vm_kib
from test_http import REPLICADP
from test_parallel import REQUEST, followers_of

from client.api import _app_for
from client.bench.isolation import psnr_db
from replicadp_tasks.contract.keys import ATTEMPTS_KEY, REPLICA_KEY, FenceToken


def test_describe_model_gives_each_rank_its_share_or_names_the_refusal():
    """`replicadp describe-model --parallel`: Wan2.2-T2V-A14B over cfg:2,ulysses:2 gives each of 4 ranks a
    quarter of the request's transformer FLOPs (JSON and table); the tiny model's 2 heads refuse ulysses:4, and a
    bad layout is a usage error naming the option."""
    def describe(*args):
        return subprocess.run([REPLICADP, "describe-model", *args], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "REPLICADP_PARALLEL": "none"})

    a14b = describe("random:wan2.2-t2v-a14b", "--parallel", "cfg:2,ulysses:2", "--json", "-")
    fig = json.loads(a14b.stdout)
    assert fig["parallel"] == {"layout": "ulysses:2,cfg:2", "ranks": 4, "video_tokens": 14040, "refused": None,
                               "dit_flops_per_rank": fig["dit_flops"] // 4}
    assert "REPLICADP_PARALLEL=ulysses:2,cfg:2: 4 ranks, one GPU each, each holding every weight" in a14b.stderr
    tiny = describe("tiny", "--parallel", "ulysses:4")
    assert "REPLICADP_PARALLEL=ulysses:4: refused: the model's 2 attention heads do not split over 4 ranks" in \
        tiny.stdout, tiny.stdout + tiny.stderr
    bad = describe("tiny", "--parallel", "ulysses:x")
    assert bad.returncode == 2 and "Invalid value for '--parallel'" in bad.stderr and \
        "'ulysses:x': the degree must be a whole number" in bad.stderr, bad.stderr


# Guided with a negative prompt (two passes a step: what cfg splits) and unguided (one pass, on every rank).
LAYOUT_REQUESTS = [{"prompt": "a fox in a ring", "negative_prompt": "blurry", "seed": 3, "height": 64, "width": 64,
                    "num_frames": 5, "num_inference_steps": 4, "guidance_scale": 5.0},
                   {"prompt": "a fox in a ring", "seed": 3, "height": 64, "width": 64, "num_frames": 5,
                    "num_inference_steps": 4, "guidance_scale": 1.0}]


def layout_frames(model: str, layout: str, folder: Path, requests: list[dict] = LAYOUT_REQUESTS,
                  **env: str) -> tuple[list, list[int]]:
    """`requests` (LAYOUT_REQUESTS) run by one holder of `model` under `layout` in a process of its own
    (tests/layout_frames.py, which starts and ends the layout's followers; `env`: more of its settings): each
    request's frames, and how often rank 0 ran a first transformer block for it."""
    folder.mkdir()
    run = subprocess.run([sys.executable, str(Path(__file__).with_name("layout_frames.py")), str(folder),
                          json.dumps(requests)],
                         env={**os.environ, "REPLICADP_MODEL": model, "REPLICADP_PARALLEL": layout,
                              "REPLICADP_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", **env},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    frames = [np.load(folder / f"{i}.npy") for i in range(len(requests))]
    return frames, json.loads(run.stdout.splitlines()[-1])["block_calls"]


@pytest.mark.cluster
@pytest.mark.parametrize("model, layouts", [("tiny", ["cfg:2,ulysses:2", "ulysses:2,ring:2"]),
                                            ("tiny-a14b", ["cfg:2"])])
def test_every_layout_computes_the_frames_of_one_process(model_cache, tmp_path, model, layouts):
    """The same requests (guided with a negative prompt, and unguided) on one process and under each layout (gloo):
    cfg:2,ulysses:2 and ulysses:2,ring:2 over 4 ranks (each kind of split, each in a combination; cfg:2,ring:2 is
    the replica's below), cfg:2 on the two-expert tiny-a14b (each expert's passes split). cfg and Ulysses give one
    process's frames bit for bit; ring merges key/value blocks by their log-sum-exp, which rounds otherwise: within
    1 level of 255 (PSNR >= 40 dB). Under cfg rank 0 runs one transformer pass a step where one process runs two
    (the unconditional pass ran on the other half of the ranks), and both where a request runs unguided."""
    one, one_calls = layout_frames(model, "none", tmp_path / "none")
    assert one_calls == [2 * 4, 4]  # 4 steps: two passes each guided, one unguided (one expert a step)
    for layout in layouts:
        frames, calls = layout_frames(model, layout, tmp_path / layout.replace(":", "").replace(",", "-"))
        for mine, theirs in zip(frames, one):
            if "ring" in layout:
                assert np.abs(mine.astype(int) - theirs.astype(int)).max() <= 1 and psnr_db(mine, theirs) >= 40
            else:
                assert np.array_equal(mine, theirs), layout
        if "cfg" in layout:
            assert calls == [one_calls[0] // 2, one_calls[1]], (layout, calls, one_calls)
        else:
            assert calls == one_calls, (layout, calls, one_calls)


@pytest.mark.cluster
def test_a_replica_over_cfg_and_ring_serves_cancels_and_serves_the_same_again(redis_db, tiny_model, tmp_path):
    """One replica over 4 ranks, `REPLICADP_PARALLEL=cfg:2,ring:2` (the two passes of a step on two pairs of
    ranks, each pair splitting the video tokens by ring attention): a guided request through Python says its
    layout; a request cancelled mid-denoising ends cancelled on all four ranks at one step, and the first request
    sent again on the same ranks gives its frames and MP4 again, bit for bit: nothing of the cancelled request
    stayed behind in the split."""
    url = redis_db()
    group = start_replicas(1, url, "cfg2-ring2", REPLICADP_PARALLEL="cfg:2,ring:2", OUTPUT_DIR=str(tmp_path))
    app = SimpleNamespace(app=_app_for(url))
    try:
        first = run_client_on(url, [{**REQUEST, "negative_prompt": "blurry"}], concurrency=1, timeout=120)[0]
        assert first.ok, first.error
        assert first.result["served"] == {"parallel": "ring:2,cfg:2"}  # the canonical order: ulysses, ring, cfg
        pid = json.loads(redis.Redis.from_url(url).get(REPLICA_KEY + group.names[0]))["pid"]
        assert len(followers_of(pid)) == 3
        request = {"prompt": "to be cancelled", **tiny_request_lasting(30, lambda r: run_client_on(
            url, [r], concurrency=1, timeout=120)[0].result)}
        result = app.app.send_task("replicadp.generate", kwargs=request)
        wait_for_step(app, result.id, 1)
        run = subprocess.run([REPLICADP, "cancel", result.id], env={**os.environ, "REDIS_URL": url},
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stdout + run.stderr
        with pytest.raises(Exception, match="cancelled at step"):
            result.get(timeout=120)
        again = run_client_on(url, [{**REQUEST, "negative_prompt": "blurry", "request_id": "again"}],
                              concurrency=1, timeout=120)[0]
    finally:
        group.stop()
    assert again.ok, again.error
    assert again.result["execution"].split(":")[1] == str(pid)
    assert (again.result["frames_sha256"], again.result["video_sha256"]) == (first.result["frames_sha256"],
                                                                     first.result["video_sha256"])


@pytest.mark.cluster
def test_out_of_memory_on_any_rank_fails_the_request_once_and_the_group_serves_on(redis_db, tmp_path):
    """Out of memory on a rank (its address space capped: the CPU stand-in for a CUDA OOM on one of the replica's
    GPUs) fails the request with OutOfMemory naming the rank, after one start (not requeued: it would fail again),
    and the replica's ranks form their group again (a new pool child and follower) to serve the next request,
    which is requeued before it is counted. Once on the follower (mid-denoising: it reports the OOM to rank 0 as it
    exits), once on rank 0 (in its VAE decode, which the follower does not run)."""
    url = redis_db()
    group = start_replicas(1, url, "ulysses2-oom", REPLICADP_PARALLEL="ulysses:2", OUTPUT_DIR=str(tmp_path),
                           REPLICADP_MAX_WORK=str(10**12))
    client = redis.Redis.from_url(url)
    huge = {"prompt": "too big", "height": 1024, "width": 1024, "num_frames": 81, "num_inference_steps": 2}
    seen = []
    try:
        for rank in (1, 0):
            pid = json.loads(client.get(REPLICA_KEY + group.names[0]))["pid"]
            (follower,) = followers_of(pid)
            assert run_client_on(url, [REQUEST], concurrency=1, timeout=120)[0].ok  # its peak of a small request
            # The follower: 8 MiB above its size now, so that the huge request's first large allocation (its latents,
            # 16.5 MiB) is what fails; above its peak, the latents fit in the headroom and what failed next could be a
            # oneDNN kernel's code buffer ("could not create a primitive": not an out of memory, the group lost).
            # Rank 0: 1 GiB above its peak so far, through the denoising, out of memory in its VAE decode.
            where, field, above_kib = (follower, "VmSize", 8 * 1024) if rank == 1 else (pid, "VmPeak", 1024 * 1024)
            cap = (vm_kib(where, field) + above_kib) * 1024
            resource.prlimit(where, resource.RLIMIT_AS, (cap, cap))
            failed, after = run_client_on(url, [huge, {**REQUEST, "seed": rank}], concurrency=1, timeout=120)
            seen.append((rank, pid, failed, after, int(client.get(ATTEMPTS_KEY + failed.task_id)),
                         int(client.get(ATTEMPTS_KEY + after.task_id))))
    finally:
        group.stop()
    for rank, pid, failed, after, failed_starts, after_starts in seen:
        assert not failed.ok and failed.error.startswith(
            f"OutOfMemory: height=1024 width=1024 num_frames=81: out of memory on cpu (rank {rank}: "), failed.error
        assert failed.error.endswith("the replica serves on once its ranks have formed their group again")
        assert failed_starts == 1 and after_starts == 1
        assert after.ok and after.result["redelivered"], after.error  # requeued by the pool child that ended
        assert FenceToken.parse(after.result["execution"]).pid != pid  # the rebuilt group's pool child
