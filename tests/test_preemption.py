"""Preemption at a step boundary (issue #58): a request stopped at step k, its state saved (model/checkpoint.py),
goes on from step k with the frames of a run never stopped: on one pipeline holder at every step, on both sides of
a two-expert model's boundary, with a first frame, an adapter switched on and a few-step recipe; the fast path
starts again instead. Then on replicas: `replicadp preempt` stops a batch request for an interactive one, which
runs first, and the batch request goes on from its step (REPLICADP_MAX_PREEMPTIONS bounds how often); and the
isolation protocol's 16 inputs, each preempted at a random step and resumed on whichever of two replicas takes
it, give their uninterrupted baseline's frames and MP4 bit for bit."""

import os
import random
import signal
import subprocess
import uuid
from types import SimpleNamespace

import numpy as np
import pytest
import redis
from PIL import Image

from conftest import SESSION_DIR, start_replicas
from helpers import SYNTHETIC, holder, lasting, parent_of, wait_for, wait_for_step
from test_http import REPLICADP, form_of, gateway, job_once, post
from test_layouts import LAYOUT_REQUESTS, layout_frames

from client.api import _app_for
from replicadp_tasks.contract import RequestPreempted, validate_request
from replicadp_tasks.contract.keys import (ATTEMPTS_KEY, CANCEL_CHANNEL, CHECKPOINT_KEY, PREEMPT_KEY,
                                           PREEMPTIONS_KEY)
from replicadp_tasks.model import CacheMethod, StepCache, save_tiny_turbo
from replicadp_tasks.model.architectures import expert_steps
from replicadp_tasks.contract.scheduling import Priority
from replicadp_tasks.model.checkpoint import Checkpoint
from replicadp_tasks.replica.preemption import Busy, choose, left_s

REQUEST = {"prompt": "a heron lands", "seed": 7, "height": 64, "width": 64, "num_frames": 5,
           "num_inference_steps": 8}


def stopped_at(h, req, step: int, image=None) -> Checkpoint:
    """`req` run on holder `h` and preempted at `step`: its checkpoint, through bytes as it crosses Redis."""
    def preempt(at: int, total: int) -> None:
        if at == step:
            raise RequestPreempted(f"at step {at} of {total}")

    with pytest.raises(RequestPreempted) as stopped:
        h.generate(req, image, on_step=preempt)
    assert stopped.value.checkpoint is not None and stopped.value.checkpoint.step == step
    return Checkpoint.from_bytes(stopped.value.checkpoint.to_bytes())


def resumed(h, req, ck: Checkpoint, image=None) -> np.ndarray:
    """`req` resumed from `ck` on `h`; asserts the steps it ran are those after the checkpoint's."""
    seen = []
    frames = h.generate(req, image, on_step=lambda step, total: seen.append(step), resume=ck)
    assert seen == list(range(ck.step + 1, req.num_inference_steps + 1)), seen
    return frames


@pytest.mark.parametrize("spec", ["tiny", "tiny-a14b"])
def test_a_request_preempted_at_any_step_goes_on_with_the_frames_of_a_run_never_stopped(spec, model_cache):
    """Preempted after each of its first 7 of 8 steps, and resumed (on the same holder, from the checkpoint's
    bytes), a request gives the uninterrupted run's frames bit for bit; on tiny-a14b at steps before, at and after
    its switch from the high-noise expert to the low-noise one; and running the uninterrupted request again after
    the resumes gives its frames too (nothing of a resume stays behind). A resumed run's FLOPs are those of the
    steps it ran."""
    h = holder(spec, model_cache)
    req = validate_request(REQUEST, h.accepts)
    full = h.generate(req)
    if spec == "tiny-a14b":
        high, low = expert_steps(h.pipe.scheduler, 8, h.boundary_ratio)
        assert 1 < high < 7 and low > 1, (high, low)  # steps on both sides of the boundary are among those below
    for step in range(1, 8):
        assert np.array_equal(resumed(h, req, stopped_at(h, req, step)), full), step
        assert h.last_run.dit_flops == h.dit_flops(req, step) < h.dit_flops(req)  # the steps it ran, not all
    assert np.array_equal(h.generate(req), full)


def test_a_first_frame_an_adapter_and_a_recipe_resume_exactly_and_the_fast_path_starts_again(model_cache,
                                                                                              tmp_path):
    """Resumed at step 3 with the frames of a run never stopped: a TI2V request with a first frame (the i2v view
    of the pipeline), one with an adapter switched on, and one on a fused few-step model (its recipe's
    flow-match-euler scheduler at fixed timesteps). A fast-path request (its step cache's state is not saved)
    comes out of a preemption without a checkpoint: it starts again."""
    registries = save_tiny_turbo(model_cache / "tiny", tmp_path, seed=9)
    image = Image.fromarray(np.random.default_rng(1).integers(0, 255, (64, 64, 3), dtype=np.uint8))
    switched = holder("tiny", model_cache, loras_file=str(registries["adapters"]))
    for h, fields, img in ((switched, {}, image),
                           (switched, {"loras": [{"name": "turbo", "scale": 0.5}], "num_inference_steps": 4}, None),
                           (holder("tiny", model_cache, loras_file=str(registries["fused"])),
                            {"num_inference_steps": 4}, None)):
        req = validate_request({**REQUEST, **fields, **({"image": "given"} if img else {})}, h.accepts)
        full = h.generate(req, img)
        assert np.array_equal(resumed(h, req, stopped_at(h, req, 3, img), img), full), fields
    cached = holder("tiny", model_cache, cache=StepCache.of(CacheMethod.FIRST_BLOCK))
    fast = validate_request({**REQUEST, "quality": "fast"}, cached.accepts)
    assert not cached.resumable(fast)

    def preempt(step: int, total: int) -> None:
        raise RequestPreempted(f"at step {step}")

    with pytest.raises(RequestPreempted) as stopped:
        cached.generate(fast, on_step=preempt)
    assert stopped.value.checkpoint is None


@pytest.mark.cluster
def test_replicadp_preempt_lets_an_interactive_request_run_first_and_the_batch_one_goes_on(redis_db):
    """One synthetic replica busy with a batch job of 80 steps (sent over HTTP); an interactive request waits
    behind it. `replicadp preempt` stops the batch request at its next step: while the interactive one runs, the
    job API says the batch job is queued again, preempted at that step, and so does `replicadp get`; the
    interactive request completes first; the batch request then goes on from its step (its replica says so) and
    completes, preempted once. Asked again while it goes on, past REPLICADP_MAX_PREEMPTIONS=1, the preemption is
    dropped and it runs to its end; a request that is not running is not preempted (exit 1); and a preempted
    request cancelled while it is queued again fails as cancelled, its checkpoint removed with it."""
    url = redis_db()
    group = start_replicas(1, url, "preempt", model=SYNTHETIC, REPLICADP_MAX_PREEMPTIONS="1")
    on = SimpleNamespace(app=_app_for(url))  # what wait_for_step reads progress with
    env = {**os.environ, "REDIS_URL": url}
    client = redis.Redis.from_url(url)

    def cli(*args):
        return subprocess.run([REPLICADP, *args], env=env, capture_output=True, text=True, timeout=60)

    try:
        with gateway(url, "preempt") as gw:
            posted = post(gw, "/v1/videos", form_of(lasting(20, prompt="batch", priority="batch")))
            assert posted.status_code == 200, posted.text
            batch = on.app.AsyncResult(posted.json()["id"])
            wait_for_step(on, batch.id, 2)
            interactive = on.app.send_task("replicadp.generate", kwargs=lasting(6, prompt="now",
                                                                                 priority="interactive"))
            asked = cli("preempt", batch.id)
            assert asked.returncode == 0 and "preempted; it stops at its next denoising step" in asked.stdout, asked
            job = wait_for(job_once(gw, batch.id, lambda j: j["phase"] == "preempted"), "the job to be preempted")
            got = cli("get", batch.id)
            done = interactive.get(timeout=60)
            assert not batch.ready()  # the interactive request ran first: the batch one had its steps left to run
        step = job["step"]
        wait_for_step(on, batch.id, step + 1)
        again = cli("preempt", batch.id)
        assert again.returncode == 0, again
        result = batch.get(timeout=120)
        idle = cli("preempt", interactive.id)
        # A preempted request cancelled while it is queued again: its checkpoint goes with it.
        doomed = on.app.send_task("replicadp.generate", kwargs=lasting(8, prompt="doomed", priority="batch"))
        wait_for_step(on, doomed.id, 2)
        # The interactive request it is stopped for lasts far longer than a CLI call takes on a loaded machine, so
        # the cancel lands while the doomed one waits (a 4 s one ended first once, and the doomed one went on), and
        # is cancelled in turn once it has.
        first = on.app.send_task("replicadp.generate", kwargs=lasting(30, prompt="first", priority="interactive"))
        assert cli("preempt", doomed.id).returncode == 0
        wait_for(lambda: client.exists(CHECKPOINT_KEY + doomed.id), "the doomed request's checkpoint")
        cancelled = cli("cancel", doomed.id)
        assert cli("cancel", first.id).returncode == 0
        with pytest.raises(Exception, match="cancelled"):
            first.get(timeout=60)
        with pytest.raises(Exception, match="cancelled before it started"):
            doomed.get(timeout=60)
    finally:
        group.stop()
    assert "cancelled; it was queued and will not run" in cancelled.stdout, cancelled
    assert not client.exists(CHECKPOINT_KEY + doomed.id)
    assert (job["status"], job["total_steps"]) == ("queued", 80) and 2 <= step < 80, job
    assert f"{batch.id}: queued again: preempted on {group.names[0]} at step {step}/80" in got.stdout, got
    assert done["params"]["num_inference_steps"] == 24 and result["params"]["num_inference_steps"] == 80
    assert int(client.get(PREEMPTIONS_KEY + batch.id)) == 1  # the second ask was dropped: it ran to its end
    assert not client.exists(CHECKPOINT_KEY + batch.id)  # done with at its completion
    log = (SESSION_DIR / "logs" / "preempt.log").read_text()
    assert f"request {batch.id} goes on from step {step} of 80, where it was preempted" in log
    assert "preempted 1 times already (REPLICADP_MAX_PREEMPTIONS); it runs to its end" in log
    assert idle.returncode == 1 and "nothing to preempt" in idle.stdout, idle


@pytest.mark.cluster
def test_with_preempt_on_shutdown_a_sigterm_leaves_at_the_next_step_and_the_request_goes_on(redis_db):
    """One synthetic replica with REPLICADP_PREEMPT_ON_SHUTDOWN=1, SIGTERMed while it runs a request of 80 steps
    (a scale-down): its main process exits while the request is still to complete (it stopped at its next step,
    saved, and was queued again; with the setting off the replica finishes the request first:
    test_faults.py::test_sigterm_mid_request_finishes_it_first); the launcher starts the replica again, which goes
    on from the saved step and completes the request once, preempted once, never counted as a failed attempt."""
    url = redis_db()
    group = start_replicas(1, url, "shutdown", model=SYNTHETIC, REPLICADP_PREEMPT_ON_SHUTDOWN="1")
    on = SimpleNamespace(app=_app_for(url))
    client = redis.Redis.from_url(url)
    try:
        result = on.app.send_task("replicadp.generate", kwargs=lasting(20, prompt="a scale-down", seed=3))
        info = wait_for_step(on, result.id, 2)
        main = parent_of(info["pid"])
        os.kill(main, signal.SIGTERM)
        wait_for(lambda: not os.path.exists(f"/proc/{main}"), f"replica process {main} to exit", timeout=60)
        left_before_its_end = not result.ready()
        done = result.get(timeout=120)
    finally:
        group.stop()
    assert left_before_its_end and done["params"]["seed"] == 3
    assert int(client.get(PREEMPTIONS_KEY + result.id)) == 1 and int(client.get(ATTEMPTS_KEY + result.id)) == 1
    log = (SESSION_DIR / "logs" / "shutdown.log").read_text()
    assert f"stopping: request {result.id} stops at its next step" in log
    assert f"request {info['request_id']} goes on from step " in log


@pytest.mark.cluster
def test_the_isolation_protocol_holds_with_every_request_preempted_at_a_random_step(redis_db, tiny_model):
    """The protocol's 16 inputs (test_isolation's shapes): one replica records each uninterrupted, serially; then
    two replicas run them at once, each asked before it is sent to be preempted at a random step (seeded) and
    resumed on whichever replica takes it next: every input's frames and MP4 equal its baseline's bit for bit, and
    each was preempted once and resumed, not restarted."""
    url = redis_db()
    app = _app_for(url)
    client = redis.Redis.from_url(url)
    rng = random.Random(58)
    inputs = [{"prompt": f"input {i}", "seed": 100 + i, "height": 64, "width": 64, "num_frames": 9,
               "num_inference_steps": 6, "guidance_scale": 5.0 if i % 2 else 1.0} for i in range(16)]

    def run(preempt: bool) -> list[dict]:
        sent = []
        for fields in inputs:
            task_id = f"preempt-{uuid.uuid4()}"
            if preempt:
                client.set(PREEMPT_KEY + task_id, rng.randint(1, fields["num_inference_steps"] - 1), ex=600)
                client.publish(CANCEL_CHANNEL, task_id)
            sent.append(app.send_task("replicadp.generate", kwargs=fields, task_id=task_id))
        return [(r.id, r.get(timeout=300)) for r in sent]

    one = start_replicas(1, url, "preempt-baseline")
    try:
        baseline = run(preempt=False)
    finally:
        one.stop()
    two = start_replicas(2, url, "preempt-two", first=1)
    try:
        preempted = run(preempt=True)
    finally:
        two.stop()
    for (_, base), (task_id, mine) in zip(baseline, preempted):
        assert (mine["frames_sha256"], mine["video_sha256"]) == (base["frames_sha256"], base["video_sha256"])
        assert int(client.get(PREEMPTIONS_KEY + task_id)) == 1
    log = (SESSION_DIR / "logs" / "preempt-two.log").read_text()
    assert log.count(", where it was preempted") == 16, log.count(", where it was preempted")
    assert {r["replica"] for _, r in preempted} == set(two.names)


def busy(replica: str, priority: str, left: float | None, preemptions: int = 0, asked: bool = False) -> Busy:
    return Busy(replica, f"task-{replica}", Priority(priority), left, preemptions, asked)


def waits(*priorities: str) -> list[tuple[Priority, str]]:
    return [(Priority(p), f"waiting-{i}") for i, p in enumerate(priorities)]


def test_the_policy_preempts_the_lower_priority_request_with_the_most_time_left_and_only_then():
    """`choose`, with REPLICADP_PREEMPT_AFTER_S=30 and at most 2 preemptions, for the requests waiting with no
    preemption made for them: the request of a lower priority with the most time left, for the first of them; the
    first ones are left to idle replicas, to replicas that free within 30 s and to those asked to stop by hand, and
    each later one gets a preemption of its own; never a request asked to stop already, of the same or a higher
    priority, preempted twice, or not denoising; of two, the one preempted fewer times first; nothing when nothing
    waits. `left_s` reads a Progress: the time per step since its denoising phase began (as its first step
    ended), times the steps left."""
    long, longer = busy("a", "batch", 100), busy("b", "batch", 200)
    assert choose(waits("interactive"), [long, longer], idle=0, after_s=30, max_preemptions=2) == (longer,
                                                                                                   "waiting-0")
    assert choose(waits("normal"), [long, busy("b", "normal", 500)], 0, 30, 2) == (long, "waiting-0")
    assert choose(waits("interactive"), [long, longer], 1, 30, 2) is None  # an idle replica takes it
    assert choose(waits("interactive", "interactive"), [long, longer], 1, 30, 2) == (longer, "waiting-1")
    # Two waiting: the second gets the other replica, once the first has its preemption (it is no longer listed).
    assert choose(waits("interactive", "interactive"), [long, busy("b", "batch", 200, asked=True)], 0, 30, 2) == (
        long, "waiting-0")
    by_hand = frozenset({"task-b"})
    for busy_now, freeing in (([long, busy("b", "batch", 20)], frozenset()),  # b frees within 30 s
                              ([long, busy("b", "batch", 200, asked=True)], by_hand),  # b's stop frees it for this one
                              ([busy("a", "interactive", 500), busy("b", "batch", 500, preemptions=2)], frozenset()),
                              ([busy("a", "batch", None), busy("b", "batch", None)], frozenset())):  # not denoising
        assert choose(waits("interactive"), busy_now, 0, 30, 2, freeing=freeing) is None, busy_now
    assert choose(waits("interactive", "interactive"), [long, busy("b", "batch", 20)], 0, 30, 2) == (long,
                                                                                                     "waiting-1")
    assert choose([], [long], 0, 30, 2) is None
    assert choose(waits("batch"), [long], 0, 30, 2) is None  # the same priority
    assert choose(waits("normal"), [busy("a", "interactive", 500)], 0, 30, 2) is None  # a higher one
    resumed_once = busy("c", "batch", 300, preemptions=1)
    assert choose(waits("interactive"), [longer, resumed_once], 0, 30, 2) == (longer, "waiting-0")  # fewest first
    # Its denoising phase began as step 11 (its first since it went on from 10) ended: steps 12 and 13 took 4 s.
    progress = {"phase": "denoising", "step": 13, "total_steps": 50, "first_step": 10, "phase_started_at": 100.0}
    assert left_s(progress, now=104.0) == 2.0 * 37
    assert left_s({**progress, "step": 11}, 104.0) == 4.0 * 39  # its first step since: the time since stands for one
    assert left_s({**progress, "step": 10}, 104.0) is None and left_s({**progress, "phase": "decoding"}, 104.0) is None


@pytest.mark.cluster
def test_with_preempt_after_s_an_interactive_request_preempts_the_batch_request_with_the_most_left(redis_db):
    """Two synthetic replicas with REPLICADP_PREEMPT_AFTER_S=2, each running a batch request (10 s, then 20 s of
    steps): an interactive request sent then stops the 20 s one at a step (not the other, with less left), runs
    on its replica and completes while both batch requests are still to complete; the preempted one goes on from
    its step and completes, preempted once; the other never was."""
    url = redis_db()
    group = start_replicas(2, url, "policy", model=SYNTHETIC, REPLICADP_PREEMPT_AFTER_S="2")
    on = SimpleNamespace(app=_app_for(url))
    client = redis.Redis.from_url(url)
    try:
        short = on.app.send_task("replicadp.generate", kwargs=lasting(10, prompt="short batch", priority="batch"))
        wait_for_step(on, short.id, 1)
        longer = on.app.send_task("replicadp.generate", kwargs=lasting(20, prompt="long batch", priority="batch"))
        wait_for_step(on, longer.id, 2)
        interactive = on.app.send_task("replicadp.generate", kwargs=lasting(1, prompt="a person waits",
                                                                             priority="interactive"))
        done = interactive.get(timeout=60)
        assert not short.ready() and not longer.ready()
        results = short.get(timeout=120), longer.get(timeout=120)
    finally:
        group.stop()
    assert done["params"]["num_inference_steps"] == 4 and all(r["params"]["num_inference_steps"] for r in results)
    assert client.get(PREEMPTIONS_KEY + short.id) is None and int(client.get(PREEMPTIONS_KEY + longer.id)) == 1
    log = (SESSION_DIR / "logs" / "policy.log").read_text()
    assert f"preemption: request {longer.id} (batch" in log and f"request {longer.id} goes on from step" in log


@pytest.mark.cluster
@pytest.mark.parametrize("layout", ["cfg:2", "ulysses:2"])
def test_a_replica_over_two_ranks_resumes_exactly_on_every_rank(tmp_path, layout):
    """Under cfg:2 and ulysses:2 (gloo), a request preempted at step 2 on every rank at once and resumed from rank
    0's checkpoint, handed to the follower with the request, gives the layout's own uninterrupted frames bit for
    bit, guided and unguided (test_layouts.LAYOUT_REQUESTS; layout_frames.py)."""
    requests = [*LAYOUT_REQUESTS, *({**r, "preempt_at": 2} for r in LAYOUT_REQUESTS)]
    frames, _ = layout_frames("tiny", layout, tmp_path / "frames", requests=requests)
    whole, resumed = frames[:len(LAYOUT_REQUESTS)], frames[len(LAYOUT_REQUESTS):]
    assert all(np.array_equal(a, b) for a, b in zip(whole, resumed))
