"""Hostile and broken input: refused with an error naming the field, nothing crashes, nothing is lost."""

import base64
import collections
import http.server
import io
import ipaddress
import socket
import threading
import uuid
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image
from helpers import model_queue, served_by_each

from client.api import live_replicas, run_requests
from replicadp_tasks import app
from replicadp_tasks.contract import FIELDS, ImageInputError
from replicadp_tasks.contract.request import TWO_EXPERT_FIELDS
from replicadp_tasks.inputs import load_first_frame

SMALL = {"height": 64, "width": 64, "num_frames": 5, "num_inference_steps": 2}


def png_bytes(size=(40, 30), mode="RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size).save(buf, format="PNG")
    return buf.getvalue()


def frame(image, image_dir=None, max_bytes=1_000_000, timeout_s=2, allow_nets=()):
    return load_first_frame(image, 64, 64, max_bytes=max_bytes, timeout_s=timeout_s, image_dir=image_dir,
                            allow_nets=allow_nets)


# --- the wire -------------------------------------------------------------------------------------------

def _touch(path):  # what the pickle would run if a replica ever unpickled it
    Path(path).touch()


class Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (_touch, (str(self.marker),))


def test_pickled_message_is_refused_unread_and_replicas_keep_serving(replicas, tmp_path):
    """A pickle put straight on the queue, dressed as a generate task, is refused without being
    deserialised (the code inside never runs), and both replicas go on serving. Published through the queue's
    exchange, it reaches the queue alone: no replica's standby queue is bound to that exchange."""
    queue = model_queue()
    bound = app.backend.client.smembers(f"_kombu.binding.{queue}")
    assert {member.decode().rsplit("\x06\x16", 1)[-1] for member in bound} == {queue}
    marker = tmp_path / "unpickled"
    with app.producer_or_acquire() as producer:
        producer.publish(Exploit(marker), serializer="pickle", exchange=queue, routing_key=queue,
                         declare=[app.amqp.queues[queue]],
                         headers={"lang": "py", "task": "replicadp.generate", "id": str(uuid.uuid4()),
                                  "root_id": None, "parent_id": None, "group": None, "argsrepr": "", "kwargsrepr": ""})
    served_by_each(replicas.names, {"prompt": "after the pickle", **SMALL})
    assert not marker.exists()


# --- images ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("image, message", [
    ("file:///etc/passwd", "scheme not allowed"),
    ("ftp://example.com/a.png", "scheme not allowed"),
    ("/etc/passwd", "local paths are refused unless REPLICADP_IMAGE_DIR is set"),
    ("frame.png", "local paths are refused"),
    ("data:image/png,notbase64", "only base64 data URIs"),
    ("data:image/png;base64,@@@@", "invalid base64"),
    (base64.b64encode(b"not an image at all").decode(), "cannot decode"),
])
def test_image_sources_refused(image, message):
    """Disallowed schemes, local paths without a configured folder, and undecodable data are refused."""
    with pytest.raises(ImageInputError, match=message):
        frame(image)


def test_image_paths_stay_inside_the_image_dir(tmp_path):
    """With REPLICADP_IMAGE_DIR set, a file under it loads; '..' and absolute paths outside it are refused."""
    (tmp_path / "ok.png").write_bytes(png_bytes())
    img, digest = frame("ok.png", image_dir=tmp_path)
    assert img.size == (64, 64) and len(digest) == 64
    for escape in ("../../etc/passwd", "/etc/passwd", "sub/../../x.png"):
        with pytest.raises(ImageInputError, match="outside REPLICADP_IMAGE_DIR"):
            frame(escape, image_dir=tmp_path)


def test_image_size_limits():
    """Over the byte limit, or a decompression bomb (a small file declaring 64 M pixels): refused before decoding."""
    big = base64.b64encode(png_bytes((400, 400)) + b"\0" * 5000).decode()
    with pytest.raises(ImageInputError, match="more than 2000 bytes"):
        frame(big, max_bytes=2000)
    bomb = png_bytes((8000, 8000), mode="1")
    assert len(bomb) < 100_000
    with pytest.raises(ImageInputError, match="8000x8000 is more than"):
        frame(base64.b64encode(bomb).decode())


def test_image_download_timeout_and_success():
    """A server that never answers fails the image after the timeout; a real one serves the frame (both on
    loopback, allowed here: tests/test_fetch.py proves it refused by default)."""
    loopback = [ipaddress.ip_network("127.0.0.0/8")]
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    try:
        with pytest.raises(ImageInputError, match=r"took longer than 1 s \(REPLICADP_IMAGE_TIMEOUT\)"):
            frame(f"http://127.0.0.1:{silent.getsockname()[1]}/x.png", timeout_s=1, allow_nets=loopback)
    finally:
        silent.close()
    body = png_bytes()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        img, _ = frame(f"http://127.0.0.1:{server.server_port}/x.png", allow_nets=loopback)
        assert img.size == (64, 64)
    finally:
        server.shutdown()


# --- random and adversarial arguments against real replicas ------------------------------------------------

JUNK = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                 st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=30),
                 st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(), max_size=1))
PRINTABLE = st.text(st.characters(blacklist_categories=("Cc", "Cs")), min_size=1, max_size=60)
# Per field: valid values (twice, so that a fair share of requests is served), plausible mistakes, and junk.
VALID = {
    "prompt": PRINTABLE.filter(str.strip),
    "negative_prompt": PRINTABLE,
    "seed": st.integers(0, 2**63 - 1),
    "height": st.sampled_from([32, 64]),
    "width": st.sampled_from([32, 64, 96]),
    "num_frames": st.sampled_from([1, 5, 9]),
    "num_inference_steps": st.integers(1, 3),
    "guidance_scale": st.floats(0, 20),
    "fps": st.integers(1, 120),
    "max_sequence_length": st.integers(1, 512),
    "image": st.just(base64.b64encode(png_bytes()).decode()),
    "request_id": st.uuids().map(str),
    "priority": st.sampled_from(["interactive", "normal", "batch"]),
    "tenant": st.sampled_from(["acme", "team-1.prod_2"]),
    "user": st.text(st.characters(blacklist_categories=("Cc", "Cf", "Cs", "Cn", "Zl", "Zp")), min_size=1,
                    max_size=60),  # scheduling.check_user refuses invisible and control characters
    "quality": st.just("standard"),  # the session's replicas have no step cache: fast is a mistake here
    "webhook": st.just("https://example.com/hook"),  # refused here all the same: these replicas have no secret
    "webhook_events": st.sampled_from([["completed"], ["started", "progress", "completed", "failed"]]),
    "loras": st.just([]),  # the session's replicas register no adapter: none is the only valid choice here
    "model": st.just("tiny"),  # the session's replicas' model
}
MISTAKES = {
    "prompt": st.sampled_from(["", "   ", "a\x00b", "\x1b[2J", "x" * 5000]),
    "negative_prompt": st.sampled_from(["\x07", "y" * 5000]),
    "seed": st.sampled_from([-1, 2**64, 1.5, "7"]),
    "height": st.sampled_from([0, -64, 48, 4096, 64.0]),
    "width": st.sampled_from([33, 8192, "64"]),
    "num_frames": st.sampled_from([0, 4, 2000, 9.0]),
    "num_inference_steps": st.sampled_from([0, -1, 201, True]),
    "guidance_scale": st.sampled_from([-0.1, 20.5, float("nan"), float("inf")]),
    "guidance_scale_2": st.sampled_from([-0.1, 20.5, float("nan"), "4"]),
    "boundary_ratio": st.sampled_from([-0.1, 1.5, True, "0.5"]),
    "fps": st.sampled_from([0, 121, "24"]),
    "max_sequence_length": st.sampled_from([0, 513]),
    "image": st.sampled_from(["/etc/passwd", "file:///etc/passwd", "http://127.0.0.1:1/x.png", "", "Zm9v",
                              "data:image/png;base64,!!"]),
    "request_id": st.sampled_from(["../../etc/passwd", "a" * 200, "x\x00y", "bad id", "/abs", ""]),
    "priority": st.sampled_from(["urgent", "HIGH", "", 0, 9]),
    "tenant": st.sampled_from(["", "-acme", "a b", "t" * 65, "a\u200bb", 7]),
    "user": st.sampled_from(["", "a\x00b", "\x1b[2J", "u" * 300, 7, "ali\u200bce", "\u202eevil", "a\x85b"]),
    "quality": st.sampled_from(["fast", "hd", "", "STANDARD", 1]),
    "webhook": st.sampled_from(["ftp://example.com/x", "http://127.0.0.1:1/x", "http://user:pw@example.com/", "",
                                "http://example.com/" + "a" * 3000, "http://example.com/a\x00b"]),
    "webhook_events": st.sampled_from(["completed", [], ["done"], [5], [["completed"]]]),
    "loras": st.sampled_from(["style", {"name": "style"}, [{"name": "style"}], [{"name": "../x"}], [1],
                              [{"name": "a", "scale": 9}], [{"name": "a", "scale": float("nan")}],
                              [{"name": "a", "path": "/etc/passwd"}], [{"name": "a"}] * 5]),
    "model": st.sampled_from(["tiny-a14b", "", "a b", "../x\x00", "Tiny", "m" * 201]),
}
SIZE_FIELDS = ("prompt", "height", "width", "num_frames", "num_inference_steps")
DROP = object()  # a mutation that removes the field
# A small valid request, then 0-2 of its fields turned into a mistake, junk or nothing, and rarely an unknown key.
# The two-expert fields come only as mutations: the session's replicas serve a one-expert model (tiny), which
# refuses them whatever their value, and that refusal would hide the other fields' checks.
BASE = st.fixed_dictionaries({f: VALID[f] for f in SIZE_FIELDS},
                             optional={f: VALID[f] for f in FIELDS if f not in SIZE_FIELDS + TWO_EXPERT_FIELDS})
MUTATION = st.sampled_from(FIELDS).flatmap(lambda f: st.tuples(st.just(f), st.one_of(MISTAKES[f], JUNK, st.just(DROP))))
EXTRA = st.one_of(st.just({}), st.just({}), st.just({}),
                  st.dictionaries(st.sampled_from(["steps", "size", "__class__", "prompt\x00"]), JUNK, max_size=1))


def _apply(parts):
    kwargs, mutations, extra = parts
    kwargs = {**kwargs, **extra}
    for field, value in mutations:
        if value is DROP:
            kwargs.pop(field, None)
        else:
            kwargs[field] = value
    return kwargs


ARGS = st.tuples(BASE, st.lists(MUTATION, max_size=2), EXTRA).map(_apply)
TALLY = collections.Counter()


# 120 requests in all, sent 10 at a time: both replicas busy, as under real traffic (and a tenth of the time).
BATCH = 10


@settings(max_examples=120 // BATCH, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(batch=st.lists(ARGS, min_size=BATCH, max_size=BATCH))
def test_any_arguments_succeed_or_fail_naming_a_field(replicas, batch):
    """Random and adversarial generate arguments (hypothesis), sent 10 at once, either succeed or fail with a
    validation error that names a field the caller sent (or the missing prompt); none crashes or hangs a
    replica."""
    for outcome in run_requests(batch, timeout=60):
        if outcome.ok:
            TALLY["served"] += 1
            continue
        kind, _, message = outcome.error.partition(": ")
        assert kind in ("InvalidRequest", "ImageInputError", "RequestIdConflict"), (outcome.error, outcome.request)
        field = message.split("=", 1)[0]
        assert field in outcome.request or field == "prompt" or field.startswith("height x width"), \
            (outcome.error, outcome.request)
        TALLY[f"refused: {field}"] += 1


def test_replicas_still_serve_after_the_hostile_input(replicas):
    """After everything above, both replicas are live and serve valid requests."""
    assert set(live_replicas()) == set(replicas.names)
    served_by_each(replicas.names, {"prompt": "still here", **SMALL})
    if TALLY:
        print("\nhypothesis outcomes:", dict(sorted(TALLY.items())), "total", sum(TALLY.values()))
