"""The worker side end to end: real Valkey, two real replica processes, the tiny Wan pipeline (progress
reporting on the synthetic backend, whose steps take a set time)."""

import time
import uuid

import pytest
from celery.result import AsyncResult

from client.api import _app_for, fetch_video, live_replicas, run_requests
from conftest import start_replicas
from helpers import SYNTHETIC, SYNTHETIC_STEP_S, lasting, served_by_each, wait_for
from replicadp_tasks import app, generate
from replicadp_tasks.contract import InvalidRequest, RequestIdConflict
from replicadp_tasks.contract import RequestState
from replicadp_tasks.replica.delivery import PROGRESS_EVERY_S
from replicadp_tasks.outputs import decode_mp4, frames_sha256

SMALL = {"height": 64, "width": 64, "num_frames": 9, "num_inference_steps": 4}


def run_all(requests, concurrency=0):
    outcomes = list(run_requests(requests, concurrency=concurrency, timeout=120))
    assert all(o.ok for o in outcomes), [o.error for o in outcomes if not o.ok]
    return sorted(outcomes, key=lambda o: o.index)


def test_two_replicas_serve_distinct_requests(replicas):
    """Concurrent requests spread over both replicas, each result carries its own input's identity, and
    distinct seeds give distinct videos."""
    outcomes = run_all([{"prompt": "a red fox in snow", "seed": s, **SMALL} for s in range(8)])
    assert {o.result["replica"] for o in outcomes} == set(replicas.names)
    assert [o.result["params"]["seed"] for o in outcomes] == list(range(8))
    assert len({o.result["frames_sha256"] for o in outcomes}) == 8
    for o in outcomes:
        assert o.result["model"] == "tiny" and o.result["device"] == "cpu"
        assert o.result["request_id"] == o.task_id
        t = o.result["timings"]
        assert t["queued_s"] >= 0 and t["inference_s"] > 0 and t["encode_s"] > 0
        assert t["total_s"] >= t["inference_s"] + t["encode_s"]


def test_same_input_same_output_on_either_replica(replicas):
    """One input sent many times (under fresh request ids) is served by both replicas with bit-identical
    frames and MP4 bytes: the output depends on the input alone."""
    outcomes = run_all([{"prompt": "waves on black rocks", "seed": 11, **SMALL} for _ in range(8)])
    assert {o.result["replica"] for o in outcomes} == set(replicas.names)
    assert len({o.result["frames_sha256"] for o in outcomes}) == 1
    assert len({o.result["video_sha256"] for o in outcomes}) == 1


def test_mp4_decodes_to_the_asked_frames_and_size(replicas):
    """The stored MP4 decodes to exactly num_frames frames of height x width, and hashing the decoded
    frames is stable (lossy H.264, so not equal to frames_sha256; the same bytes decode the same)."""
    meta = generate.delay(prompt="a paper boat", seed=3, height=64, width=96, num_frames=13,
                          num_inference_steps=2).get(timeout=60)
    data = fetch_video(meta)
    frames = decode_mp4(data)
    assert frames.shape == (13, 64, 96, 3)
    assert frames_sha256(frames) == frames_sha256(decode_mp4(data))
    assert meta["params"]["height"] == 64 and meta["params"]["width"] == 96


def test_progress_is_reported_while_denoising(redis_db):
    """While a request runs, AsyncResult(id).info reports PROGRESS with step, total_steps and replica: the first
    step at once, then at most every PROGRESS_EVERY_S (not a Redis write per step: here the steps take half
    that)."""
    assert SYNTHETIC_STEP_S < PROGRESS_EVERY_S
    url = redis_db()
    group = start_replicas(1, url, "progress", model=SYNTHETIC)
    try:
        other = _app_for(url)
        result = other.send_task("replicadp.generate", kwargs=lasting(6, prompt="a hummingbird", seed=5))
        seen, first, last = [], None, None

        def sample() -> bool:
            nonlocal first, last
            meta = other.backend.get_task_meta(result.id)  # state and info read together, not one after the other
            if meta["status"] == RequestState.PROGRESS:
                seen.append(meta["result"])
                first, last = first or time.monotonic(), time.monotonic()
            return result.ready()

        wait_for(sample, "the request to end", interval=0.005)
        assert result.successful()
    finally:
        group.stop()
    assert seen, "no PROGRESS state observed"
    assert all(s["total_steps"] == 24 and s["replica"] == group.names[0] for s in seen)
    steps = [s["step"] for s in seen]
    assert steps == sorted(steps) and steps[0] == 1 and steps[-1] <= 24
    reports = len(set(steps))
    assert 3 <= reports < 24, f"{reports} PROGRESS steps seen of 24"
    assert reports <= (last - first) / PROGRESS_EVERY_S + 2, f"{reports} PROGRESS writes in {last - first:.2f} s"


@pytest.mark.parametrize("bad, message", [
    ({"width": 48}, "width=48: must be a multiple of 32"),
    ({"num_frames": 10}, "num_frames=10: must be of the form 4k+1"),
    ({"num_inference_steps": 0}, "num_inference_steps=0: must be between 1 and 200"),
    ({"guidance_scale": float("nan")}, "guidance_scale=nan: must be a finite number"),
    ({"prompt": "   "}, "prompt='   ': must not be empty"),
    ({"colour": "red"}, "colour='red': unknown argument"),
])
def test_invalid_request_fails_and_replicas_keep_serving(replicas, bad, message):
    """An invalid request ends in FAILURE with a message naming the field and value, is not retried, and
    both replicas then serve valid requests."""
    result = generate.delay(**{"prompt": "a fox", **SMALL, **bad})
    with pytest.raises(InvalidRequest, match=message.replace("(", r"\(").replace("+", r"\+")) as err:
        result.get(timeout=60)
    # Rebuilt from the result backend's JSON with its field and value as attributes, not only in the message.
    field, value = message.split(": ")[0].split("=", 1)
    assert (err.value.field, err.value.value) == (field, value)
    assert AsyncResult(result.id, app=app).state == RequestState.FAILURE
    assert set(live_replicas()) == set(replicas.names)
    served_by_each(replicas.names, {"prompt": "still serving", **SMALL})


def test_request_id_is_an_idempotency_key(replicas):
    """A second request with a completed request_id and the same inputs returns the stored result without
    recomputing it; the same request_id with other inputs is refused."""
    rid = f"idem-{uuid.uuid4().hex}"
    first = generate.delay(prompt="a steam train", seed=1, request_id=rid, **SMALL).get(timeout=60)
    again = generate.delay(prompt="a steam train", seed=1, request_id=rid, **SMALL).get(timeout=60)
    assert first["request_id"] == again["request_id"] == rid
    assert again["redelivered"] is True and first["redelivered"] is False
    assert again["frames_sha256"] == first["frames_sha256"] and again["timings"] == first["timings"]
    with pytest.raises(RequestIdConflict, match=rid) as err:
        generate.delay(prompt="a steam train", seed=2, request_id=rid, **SMALL).get(timeout=60)
    assert err.value.field == "request_id" and err.value.value == repr(rid)


def test_first_frame_image_input(replicas):
    """A base64 first frame goes through the image-to-video pipeline sharing the loaded weights; the
    image's hash is part of the input identity, so another image gives another video."""
    import base64
    import io

    from PIL import Image

    def png(colour):
        buf = io.BytesIO()
        Image.new("RGB", (80, 80), colour).save(buf, format="PNG")
        return base64.b64encode(buf.getvalue()).decode()

    red = generate.delay(prompt="a ball", image=png("red"), **SMALL).get(timeout=60)
    blue = generate.delay(prompt="a ball", image=png("blue"), **SMALL).get(timeout=60)
    assert red["params"]["image_sha256"] and red["params"]["image_sha256"] != blue["params"]["image_sha256"]
    assert red["frames_sha256"] != blue["frames_sha256"]
    with pytest.raises(InvalidRequest, match="image"):
        generate.delay(prompt="a ball", image="aGVsbG8=", **SMALL).get(timeout=60)
