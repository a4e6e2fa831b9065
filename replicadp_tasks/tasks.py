"""The `generate` task: validate, run the resident pipeline, store the video, return metadata."""

from __future__ import annotations

import hashlib
import logging
import os
import time

from . import lease, worker
from .app import app
from .errors import InvalidRequest, PoisonRequest, RequestCancelled, RequestIdConflict
from .images import load_first_frame
from .pipeline import describe_device
from .settings import SETTINGS
from .transport import STATS_KEY
from .validate import input_key, validate_request
from .video import encode_mp4, frames_sha256

log = logging.getLogger("replicadp")
FENCE_POLL_S = 0.5  # how often a delivery waiting on another's fence looks for its result
# PROGRESS at most this often (the first step always): each is a read and a write of the result key, ~2 ms on a
# small machine, and a GPU step takes ~0.2 s; a person, `status` and `health` need no more than this.
PROGRESS_EVERY_S = 0.5


@app.task(name="replicadp.generate", bind=True, Request="replicadp_tasks.worker:ReplicaRequest")
def generate(self, prompt=None, **kwargs):
    """Generate one video; returns JSON metadata (never the bytes: those go to the output store)."""
    started = time.time()
    if worker.cancelled(self.request.id):
        raise RequestCancelled(f"request {self.request.id} was cancelled before it started")
    attempt = worker.start_attempt(self.request.id)
    if attempt > SETTINGS.max_attempts:
        worker.record_poison(self.request.id, {"prompt": prompt, **kwargs}, attempt - 1)
        raise PoisonRequest(f"request {self.request.id} ended its replica's process {attempt - 1} times; not "
                            f"retried again (REPLICADP_MAX_ATTEMPTS={SETTINGS.max_attempts})")
    pipeline = worker.holder()
    req = validate_request({"prompt": prompt, **kwargs}, size_multiple=pipeline.size_multiple,
                           max_prompt_chars=SETTINGS.max_prompt_chars, max_work=SETTINGS.max_work)
    request_id = req.request_id or self.request.id
    image, image_sha256 = None, None
    if req.image is not None:
        if not pipeline.accepts_image:
            raise InvalidRequest(f"image={req.image[:40]!r}: model {SETTINGS.model!r} is text-to-video only and "
                                 "takes no first frame")
        image, image_sha256 = load_first_frame(
            req.image, req.width, req.height, max_bytes=SETTINGS.max_image_bytes,
            timeout_s=SETTINGS.image_timeout_s, image_dir=SETTINGS.image_dir, allow_nets=SETTINGS.fetch_allow,
            cancelled=lambda: worker.cancelled(self.request.id))
    params = req.params(image_sha256)
    key = input_key(params, SETTINGS.model)

    replica = self.request.hostname
    # At-least-once delivery, one result: a request that already has a result gets it back, and only the
    # delivery that holds the fence computes (another waits for its result; see lease.py).
    fence, tok = lease.LOCK_KEY + request_id, lease.token(replica, os.getpid(), self.request.id)
    done = take_fence(fence, tok, request_id)
    if done is not None:
        if done["input_key"] != key:
            raise RequestIdConflict(f"request_id={request_id!r}: already used for different inputs")
        return {**done, "redelivered": True}
    worker.fences().current = (fence, tok)
    try:
        return compute(self, req, image, params, key, request_id, replica, fence, tok, started)
    finally:
        worker.fences().current = None
        lease.release(worker.redis_client(), fence, tok)


def take_fence(fence: str, tok: str, request_id: str) -> dict | None:
    """Hold the fence of `request_id`, or return its stored result if one exists or appears meanwhile."""
    store, r = worker.store(), worker.redis_client()
    waiting_on = None
    while True:
        owner = lease.acquire(r, fence, tok, SETTINGS.lease_s)
        done = store.get_meta(request_id)  # after the fence: a result stored just before we took it counts
        if owner in ("acquired", "held"):
            if done is not None:
                lease.release(r, fence, tok)
            return done
        if done is not None:
            return done
        if owner != waiting_on:
            log.warning("request %s is being computed by %s; waiting for its result", request_id, owner)
            waiting_on = owner
        time.sleep(FENCE_POLL_S)


def compute(task, req, image, params, key, request_id, replica, fence, tok, started) -> dict:
    """Run the pipeline, encode, store; the result's metadata."""
    pipeline, store, r = worker.holder(), worker.store(), worker.redis_client()

    reported = 0.0  # when PROGRESS was last written

    def still_ours(owner: str) -> None:
        # A Redis restart may have expired the fence (taken again: "acquired"). If another delivery holds it, or
        # held it and stored the result, this one was presumed dead (its replica stopped past a lease): stop, and
        # requeue rather than ack (the shared delivery tag would otherwise acknowledge the other's message).
        if owner == "acquired" and store.get_meta(request_id) is not None:
            owner = "a delivery that stored its result"
        if owner not in ("acquired", "held"):
            log.error("request %s: fence taken by %s; this delivery stops and its process exits", request_id, owner)
            os._exit(75)

    def progress(step, total):
        nonlocal reported
        owner = lease.acquire_unless(r, fence, tok, SETTINGS.lease_s, worker.CANCEL_KEY + task.request.id)
        if owner == "cancelled":
            raise RequestCancelled(f"request {task.request.id} was cancelled at step {step} of {total}")
        still_ours(owner)
        if time.monotonic() - reported >= PROGRESS_EVERY_S:
            reported = time.monotonic()
            task.update_state(state="PROGRESS", meta={"step": step, "total_steps": total, "replica": replica,
                                                       "request_id": request_id, "pid": os.getpid()})

    inference_started = time.time()
    frames = pipeline.generate(req, image, on_step=progress)
    inferred, cost = time.time(), pipeline.last_run
    video = encode_mp4(frames, req.fps)
    encoded = time.time()
    sent_at = task.request.get("replicadp_sent_at")
    meta = {
        "request_id": request_id,
        "replica": replica,
        "device": describe_device(pipeline.device),
        "model": SETTINGS.model,
        "params": params,
        "input_key": key,
        "frames_sha256": frames_sha256(frames),
        "video_sha256": hashlib.sha256(video).hexdigest(),
        "timings": {
            "queued_s": round(started - sent_at, 4) if sent_at else None,
            "inference_s": round(inferred - inference_started, 4),
            "dit_s": round(cost.dit_s, 4) if cost.dit_s is not None else None,  # the denoising loop's share
            "encode_s": round(encoded - inferred, 4),
            "total_s": round(time.time() - started, 4),
        },
        "dit_flops": cost.dit_flops,
        "peak_memory_gib": cost.peak_memory_gib,
        "execution": tok,
        "redelivered": bool(task.request.delivery_info.get("redelivered")),
    }
    still_ours(lease.acquire(r, fence, tok, SETTINGS.lease_s))  # decoding and encoding check no fence
    stored = store.put(request_id, video, meta)
    if stored["execution"] != tok:  # another delivery computed it too: fenced wrongly, or an old result
        r.hincrby(STATS_KEY, "duplicate_executions", 1)
    worker.record_completion(request_id)
    return stored
