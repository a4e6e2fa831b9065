"""What the tests share besides fixtures: waiting for an event, and requests whose running time a test sets
rather than takes from the speed of the machine."""

import json
import math
import time

import redis
from celery import states

from replicadp_tasks.broker import next_request
from replicadp_tasks.cluster import connection, fleet
from replicadp_tasks.contract import MAX_STEPS, REFERENCE_WORK, RequestState, queue_for
from replicadp_tasks.contract.keys import REPLICA_KEY
from replicadp_tasks.model import ModelOptions
from replicadp_tasks.settings import SETTINGS

# torch's, MKL's and oneDNN's switches to their AVX2 code: what an AVX2-only machine runs.
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def wait_for(predicate, what: str, timeout: float = 60.0, interval: float = 0.2):
    """Poll `predicate()` until it returns something truthy, and return that. Past `timeout` seconds, a
    TimeoutError that says what was awaited (`what`) and what the predicate last returned."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"waited {timeout:g} s for {what}; last seen: {value!r:.300}")
        time.sleep(interval)


def model_queue(model: str = "tiny") -> str:
    """The queue of `model`'s requests."""
    return queue_for(SETTINGS.queue, model)


def queue_depth(client: redis.Redis, model: str = "tiny") -> int:
    """Requests waiting for `model`, every priority."""
    return sum(next_request(client, model_queue(model))[0].values())


def declare(url: str, *models: str) -> None:
    """Declare `models` on `url` (cluster/fleet.py), as a deployment's REPLICADP_MODELS does: requests for them are
    queued while no replica of theirs is live."""
    fleet.declare(connection.client(url), models, SETTINGS.queue, "a test")


def declared(url: str, *models: str) -> str:
    """`url`, with `models` declared on it."""
    declare(url, *models)
    return url


def parent_of(pid: int) -> int:
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])


def progress(app, task_id: str, what: str) -> dict | None:
    """The PROGRESS info of `task_id`, None before it runs; an error if it ended first (too short a request)."""
    meta = app.backend.get_task_meta(task_id)
    assert meta["status"] not in states.READY_STATES, f"{task_id} ended ({meta['status']}) before {what}"
    return meta["result"] if meta["status"] == RequestState.PROGRESS else None


def wait_for_step(group, task_id: str, step: int) -> dict:
    """The PROGRESS info of `task_id` once it has reached `step`."""
    what = f"{task_id} to reach step {step}"

    def reached():
        info = progress(group.app, task_id, what)
        return info if info and info["step"] >= step else None

    return wait_for(reached, what, interval=0.01)


def wait_for_reload(client: redis.Redis, replica: str, old_pid: int) -> None:
    """Wait until `replica` has a new pool child with its model loaded."""
    wait_for(lambda: json.loads(client.get(REPLICA_KEY + replica))["pid"] != old_pid,
             f"{replica} to load its model in a pool child other than {old_pid}", timeout=120, interval=0.1)


# Replicas of the synthetic benchmark backend spend a set time per denoising step, whatever the machine, and run
# the same task, fence, progress, encoding and store code as a real model. With this spec a request of
# SYNTHETIC_SHAPE takes SYNTHETIC_STEP_S a step (SECONDS is what the 832x480x33x30 reference request would take).
# A small shape: encoding its video, the one part that is compute, takes milliseconds.
SYNTHETIC_SHAPE = {"height": 64, "width": 64, "num_frames": 5}
SYNTHETIC_STEP_S = 0.25
SYNTHETIC = f"synthetic:{SYNTHETIC_STEP_S * REFERENCE_WORK / math.prod(SYNTHETIC_SHAPE.values()):g}"


def lasting(seconds: float, **fields) -> dict:
    """A request that runs `seconds` on SYNTHETIC replicas, in steps of SYNTHETIC_STEP_S (PROGRESS: the first
    step, then at most every 0.5 s)."""
    steps = round(seconds / SYNTHETIC_STEP_S)
    assert 1 <= steps <= MAX_STEPS, f"{seconds} s is not 1 to {MAX_STEPS} steps of {SYNTHETIC_STEP_S} s"
    return {"prompt": "synthetic", **SYNTHETIC_SHAPE, "num_inference_steps": steps, **fields}


# Shapes to size a tiny-model request from, smallest first: a faster machine needs a larger one.
TINY_SHAPES = ({"height": 128, "width": 128, "num_frames": 17}, {"height": 256, "width": 256, "num_frames": 33},
               {"height": 480, "width": 832, "num_frames": 33})
WARM_UP_STEPS = 4


def tiny_request_lasting(seconds: float, run) -> dict:
    """A tiny-model request that denoises for at least about `seconds` on the replicas that `run(request) ->
    result` sends to, sized from warm-up requests measured there: the smallest shape whose steps, as many as
    needed, can take that long. For a test that must use the real pipeline."""
    for shape in TINY_SHAPES:
        timings = run({"prompt": "warm-up", **shape, "num_inference_steps": WARM_UP_STEPS})["timings"]
        steps = math.ceil(seconds / (timings["dit_s"] / WARM_UP_STEPS))
        if steps <= MAX_STEPS:
            return {**shape, "num_inference_steps": max(steps, WARM_UP_STEPS)}
    raise RuntimeError(f"the tiny model denoises {TINY_SHAPES[-1]} in {timings['dit_s']:.3f} s per "
                       f"{WARM_UP_STEPS} steps: {MAX_STEPS} steps of it are shorter than {seconds} s")


def served_by_each(names, request: dict, batches: int = 10) -> None:
    """Every replica in `names` serves `request` (this process's Redis): batches of 4 copies at once (seeds 0, 1,
    ...), all succeeding, until each replica has served one. Which replica takes a request is up to timing (one
    may take a whole batch): one that serves none of `batches` batches is not serving."""
    from client.api import run_requests

    seen = set()
    for batch in range(batches):
        outcomes = list(run_requests([{**request, "seed": 4 * batch + s} for s in range(4)], concurrency=4,
                                     timeout=60))
        assert all(o.ok for o in outcomes), [o.error for o in outcomes]
        seen |= {o.result["replica"] for o in outcomes}
        if seen >= set(names):
            return
    raise AssertionError(f"{sorted(set(names) - seen)} served none of {4 * batches} requests")


def holder(spec: str, model_cache, **options):
    """A loaded pipeline holder (replicadp_tasks.model.pipeline.PipelineHolder) of `spec`; `options`: its settings."""
    from replicadp_tasks.model import PipelineHolder

    h = PipelineHolder(ModelOptions(spec, model_cache=model_cache, **options))
    h.load()
    return h
