"""The `generate` task: validate, run the resident pipeline, store the video, return metadata."""

from __future__ import annotations

import hashlib
import os
import time

from . import worker
from .app import app
from .errors import InvalidRequest, PoisonRequest, RequestIdConflict
from .images import load_first_frame
from .pipeline import describe_device
from .settings import SETTINGS
from .validate import input_key, validate_request
from .video import encode_mp4, frames_sha256


@app.task(name="replicadp.generate", bind=True)
def generate(self, prompt=None, **kwargs):
    """Generate one video; returns JSON metadata (never the bytes: those go to the output store)."""
    started = time.time()
    attempt = worker.start_attempt(self.request.id)
    if attempt > SETTINGS.max_attempts:
        worker.record_dead(self.request.id, {"prompt": prompt, **kwargs}, attempt - 1)
        raise PoisonRequest(f"request {self.request.id} ended its replica's process {attempt - 1} times; not "
                            f"retried again (REPLICADP_MAX_ATTEMPTS={SETTINGS.max_attempts})")
    pipeline, store = worker.holder(), worker.store()
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
            timeout_s=SETTINGS.image_timeout_s, image_dir=SETTINGS.image_dir)
    params = req.params(image_sha256)
    key = input_key(params, SETTINGS.model)

    # At-least-once delivery, one result: a request that already has a result gets it back.
    done = store.get_meta(request_id)
    if done is not None:
        if done["input_key"] != key:
            raise RequestIdConflict(f"request_id={request_id!r}: already used for different inputs")
        return {**done, "redelivered": True}

    replica = self.request.hostname

    def progress(step, total):
        self.update_state(state="PROGRESS", meta={"step": step, "total_steps": total, "replica": replica,
                                                   "request_id": request_id, "pid": os.getpid()})

    inference_started = time.time()
    frames = pipeline.generate(req, image, on_step=progress)
    inferred = time.time()
    video = encode_mp4(frames, req.fps)
    encoded = time.time()
    sent_at = self.request.get("replicadp_sent_at")
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
            "encode_s": round(encoded - inferred, 4),
            "total_s": round(time.time() - started, 4),
        },
        "redelivered": bool(self.request.delivery_info.get("redelivered")),
    }
    stored = store.put(request_id, video, meta)
    worker.record_completion(request_id)
    return stored
