"""The HTTP front door (`replicadp serve-http`) as a client sees it: real gateway processes, spoken to with
httpx, in front of real replicas (the tiny model on DB 0, one of the synthetic backend, whose requests run for
the time a test sets, on a database of its own) or of none."""

import hashlib
import io
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import av
import httpx
import pytest
import redis
import schemathesis
from conftest import SESSION_DIR, start_replicas
from helpers import SYNTHETIC, lasting, model_queue, wait_for
from hypothesis import HealthCheck, given, settings
from PIL import Image

from client.http.auth import LINK_S, LINK_STEP_S, KeyPolicy, signed_link
from client.local.embedded import _free_port, die_with_parent, stop_pid
from replicadp_tasks.cluster import connection
from replicadp_tasks.contract import RequestState, queue_lists
from replicadp_tasks.contract.keys import CANCEL_KEY, MODELS_KEY
from replicadp_tasks.settings import SETTINGS

REPLICADP = str(Path(sys.executable).parent / "replicadp")
SMALL = {"prompt": "a fox in snow", "size": "64x64", "num_frames": "9", "num_inference_steps": "2", "seed": "5"}


def form_of(request: dict) -> dict:
    """A generate request as the HTTP form's fields."""
    form = {k: str(v) for k, v in request.items() if k not in ("height", "width")}
    return {**form, "size": f"{request['width']}x{request['height']}"}


# 50 s on the synthetic backend; cancelled long before it would end.
LONG = form_of(lasting(50, prompt="a long one"))


@contextmanager
def gateway(url: str, name: str, *args: str, **env: str):
    """A `replicadp serve-http` process on a free port, serving once its OpenAPI schema answers; stopped by PID. On
    a database where no model is declared yet (no replica started), it declares `tiny` (REPLICADP_MODELS), so that
    its requests are queued."""
    port = _free_port()
    if not connection.client(url).exists(MODELS_KEY):
        env.setdefault("REPLICADP_MODELS", "tiny")
    log_path = SESSION_DIR / "logs" / f"gateway-{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([REPLICADP, "serve-http", "--port", str(port), *args], stdout=log,
                                stderr=subprocess.STDOUT, env={**os.environ, "REDIS_URL": url, **env},
                                preexec_fn=die_with_parent)  # noqa: PLW1509 (as Replicas does)
    base = f"http://127.0.0.1:{port}"

    def serving() -> bool:
        assert proc.poll() is None, f"gateway exited ({proc.returncode}):\n{log_path.read_text()}"
        try:
            return httpx.get(f"{base}/openapi.json").status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_for(serving, f"the gateway to serve (log: {log_path})")
        with httpx.Client(base_url=base, timeout=120) as client:
            yield SimpleNamespace(url=base, client=client, redis_url=url, log_path=log_path)
    finally:
        stop_pid(proc.pid)


@pytest.fixture(scope="module")
def live(replicas, redis_server):
    """A gateway in front of the session's two tiny-model replicas (DB 0)."""
    with gateway(redis_server.url, "live") as gw:
        yield gw


@pytest.fixture(scope="module")
def closed(redis_db):
    """A gateway on a DB with no replica that refuses every request past validation (max queue 0), with a
    4 KiB limit on first frames."""
    with gateway(redis_db(), "closed", "--max-queue", "0", REPLICADP_MAX_IMAGE_BYTES="4096") as gw:
        yield gw


@pytest.fixture(scope="module")
def slow(redis_db):
    """One replica on the synthetic backend (requests take seconds, step by step) behind a gateway, on a
    database of their own."""
    url = redis_db()
    group = start_replicas(1, url, "synthetic-http", model=SYNTHETIC)
    try:
        with gateway(url, "slow") as gw:
            yield gw
    finally:
        group.stop()


def multipart(form: dict) -> dict:
    """A form as multipart parts, the way vllm-omni's clients send it (requests' files=, no file names)."""
    return {k: (None, v) for k, v in form.items()}


def post(gw, route: str, form: dict, **files) -> httpx.Response:
    return gw.client.post(route, files={**multipart(form), **files})


def mp4_frames(data: bytes) -> tuple[int, int, int, float]:
    """(frames, width, height, frame rate) of an MP4, by decoding it."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
        rate = float(stream.average_rate)
    return len(frames), frames[0].shape[1], frames[0].shape[0], rate


def job_once(gw, job_id: str, done):
    """A predicate for wait_for: the job as GET /v1/videos/{id} answers it, once `done(job)`."""
    def check():
        job = gw.client.get(f"/v1/videos/{job_id}").json()
        return job if done(job) else None
    return check


def result_meta(url: str, task_id: str) -> dict | None:
    """A task's stored result, read straight from the backend of `url` (this process's app is on DB 0)."""
    raw = redis.Redis.from_url(url).get(f"celery-task-meta-{task_id}")
    return json.loads(raw) if raw else None


def test_the_gateway_never_imports_torch():
    """The gateway holds no model: importing it (and the CLI that starts it) loads neither torch nor diffusers."""
    code = "import sys, client.http, client.cli; sys.exit('torch' in sys.modules or 'diffusers' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_sync_answers_a_decodable_mp4_of_the_asked_size(live, replicas):
    """POST /v1/videos/sync answers video/mp4 that decodes to the asked size and frame count, with the
    request id, model, replica and inference time in headers."""
    r = post(live, "/v1/videos/sync", SMALL)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "video/mp4"
    assert r.headers["x-model"] == "tiny" and r.headers["x-replica"] in replicas.names
    assert r.headers["x-request-id"] and float(r.headers["x-inference-time-s"]) > 0
    assert mp4_frames(r.content)[:3] == (9, 64, 64)


def test_the_same_input_gives_the_same_bytes_on_either_replica(live, replicas):
    """Four identical requests at once, served by both replicas, answer byte-identical MP4s (md5 and sha256
    alike); another seed answers other bytes."""
    form = {**SMALL, "size": None, "width": "64", "height": "64", "seed": "11"}
    form = {k: v for k, v in form.items() if v is not None}
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: post(live, "/v1/videos/sync", form), range(4)))
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    assert {a.headers["x-replica"] for a in answers} == set(replicas.names)
    assert len({hashlib.sha256(a.content).hexdigest() for a in answers}) == 1
    assert len({hashlib.md5(a.content).hexdigest() for a in answers}) == 1
    other = post(live, "/v1/videos/sync", {**form, "seed": "12"})
    assert other.status_code == 200 and other.content != answers[0].content


@pytest.mark.parametrize("seconds, fps, frames", [(2, 4, 9), (1, 5, 5), (1, 7, 5)])
def test_seconds_and_fps_set_the_frame_count(live, seconds, fps, frames):
    """Without num_frames, the frames of vllm-omni's video for those seconds: seconds x fps, made of the form
    4k+1 as Wan's pipelines make it ((n // 4) x 4 + 1), at that frame rate; the job shows the count."""
    form = {k: v for k, v in SMALL.items() if k != "num_frames"}
    r = post(live, "/v1/videos/sync", {**form, "seconds": str(seconds), "fps": str(fps)})
    assert r.status_code == 200, r.text
    assert mp4_frames(r.content) == (frames, 64, 64, float(fps))


def test_an_uploaded_first_frame_guides_the_video(live):
    """input_reference (an image file) is the TI2V first frame: the answer is another video than without it."""
    png = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 30, 30)).save(png, format="PNG")
    with_frame = post(live, "/v1/videos/sync", SMALL, input_reference=("frame.png", png.getvalue(), "image/png"))
    assert with_frame.status_code == 200, with_frame.text
    without = post(live, "/v1/videos/sync", SMALL)
    assert mp4_frames(with_frame.content)[:3] == (9, 64, 64) and with_frame.content != without.content


def test_async_job_life_cycle(live, replicas):
    """POST /v1/videos answers a queued job at once; it completes with progress 100; its content is the same
    MP4 a sync request for the same input answers; it is listed; DELETE forgets it."""
    r = post(live, "/v1/videos", SMALL)
    assert r.status_code == 200, r.text
    job = r.json()
    assert job["object"] == "video" and job["status"] in ("queued", "in_progress") and job["model"] == "tiny"
    assert (job["size"], job["num_frames"], job["prompt"]) == ("64x64", 9, SMALL["prompt"]) and job["error"] is None
    done = wait_for(job_once(live, job["id"], lambda j: j["status"] not in ("queued", "in_progress")),
                    f"job {job['id']} to finish", timeout=120)
    assert done["status"] == "completed" and done["progress"] == 100 and done["replica"] in replicas.names
    assert done["completed_at"] >= job["created_at"]
    content = live.client.get(f"/v1/videos/{job['id']}/content")
    assert content.status_code == 200 and content.headers["x-request-id"] == job["id"]
    assert content.content == post(live, "/v1/videos/sync", SMALL).content
    listed = live.client.get("/v1/videos", params={"limit": 100}).json()
    assert job["id"] in [j["id"] for j in listed["data"]] and listed["object"] == "list"
    deleted = live.client.delete(f"/v1/videos/{job['id']}")
    assert deleted.json() == {"id": job["id"], "object": "video.deleted", "deleted": True}
    assert live.client.get(f"/v1/videos/{job['id']}").status_code == 404
    assert live.client.get(f"/v1/videos/{job['id']}/content").status_code == 404


@pytest.mark.parametrize("change, status, field", [
    ({"size": "64by64"}, 400, "size"),
    ({"width": "128"}, 400, "size"),  # conflicts with size=64x64
    ({"num_frames": "8"}, 400, "num_frames"),
    ({"num_frames": None, "seconds": "300", "fps": "5"}, 400, "seconds"),  # 1501 frames, over 1025
    ({"prompt": "a\x00b"}, 400, "prompt"),
    ({"model": "Wan-AI/other"}, 400, "model"),
    ({"flow_shift": "5.0"}, 400, "flow_shift"),  # vllm-omni knows it; ignoring it would change the video
    ({"size": "48x64"}, 400, "width"),  # refused by the task: the tiny model needs multiples of 32
    ({"size": "128x128", "num_frames": "33", "num_inference_steps": "30"}, 400,
     "height x width x num_frames x num_inference_steps"),  # over the replicas' budget
    ({"priority": "urgent"}, 400, "priority"),
    ({"user": "u" * 300}, 400, "user"),
    ({"num_frames": "nine"}, 422, "num_frames"),
    ({"prompt": None}, 422, "prompt"),
])
def test_bad_input_is_refused_naming_the_field(live, change, status, field):
    """A malformed or invalid field is a 400 (generate's validation, in the gateway or in the task) or a 422
    (not of the field's type), with an OpenAI-style error naming the field; it never reaches a 500."""
    form = {k: v for k, v in {**SMALL, **change}.items() if v is not None}
    r = post(live, "/v1/videos/sync", form)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["message"].startswith(field), error


def test_an_invalid_async_request_creates_no_job(live):
    """POST /v1/videos with a field the gateway can check is refused at once; no job is listed for it."""
    before = live.client.get("/v1/videos", params={"limit": 100}).json()["data"]
    r = post(live, "/v1/videos", {**SMALL, "num_frames": "8"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "num_frames"
    assert live.client.get("/v1/videos", params={"limit": 100}).json()["data"] == before


def raw_multipart(parts: list[tuple[bytes, bytes]], filename: bytes | None = None) -> bytes:
    """A multipart/form-data body (boundary BOUNDARY) of (field name, value bytes) parts, byte for byte as
    given; `filename` makes every part a file."""
    disposition = b"; filename=\"" + filename + b"\"" if filename else b""
    return b"".join(b"--" + BOUNDARY + b"\r\nContent-Disposition: form-data; name=\"" + name + b"\"" + disposition +
                    b"\r\n\r\n" + value + b"\r\n" for name, value in parts) + b"--" + BOUNDARY + b"--\r\n"


BOUNDARY = b"replicadp-test-boundary"
MULTIPART = f"multipart/form-data; boundary={BOUNDARY.decode()}"
URLENCODED = "application/x-www-form-urlencoded"
SMALL_PARTS = [(k.encode(), v.encode()) for k, v in SMALL.items() if k != "prompt"]


@pytest.mark.parametrize("content_type, body, field, message", [
    (MULTIPART, raw_multipart([(b"prompt", b"caf\xe9 au lait"), *SMALL_PARTS]), "prompt",
     "prompt: not UTF-8 (byte 0xe9 at offset 3 of the value)"),  # Latin-1, not UTF-8
    (MULTIPART, raw_multipart([(b"prompt", b"a fox"), (b"negative_prompt", b"blur\xc3"), *SMALL_PARTS]),
     "negative_prompt", "negative_prompt: not UTF-8 (byte 0xc3 at offset 4"),  # cut short
    (MULTIPART, raw_multipart([(b"prompt", b"a fox"), (b"pr\xf6mpt", b"x")]), "pr\\xf6mpt", "field name"),
    (MULTIPART + "; charset=latin-1", raw_multipart([(b"prompt", b"caf\xe9")]), None, "Content-Type: charset"),
    (URLENCODED, b"prompt=caf%E9&size=64x64", "prompt", "prompt: not UTF-8 (byte 0xe9 at offset 3"),
    (URLENCODED, "prompt=café&size=64x64".encode(), "prompt", "prompt: bytes past ASCII"),  # raw, not %-encoded
])
def test_a_form_value_that_is_not_utf8_is_refused(closed, content_type, body, field, message):
    """Form text that is not UTF-8 (a value, a field name, a declared charset, in multipart or urlencoded form)
    is a 400 naming the field and the offending byte, where Starlette would have read it as Latin-1 (or with
    U+FFFD in place) and generated a video of another prompt."""
    r = closed.client.post("/v1/videos/sync", content=body, headers={"content-type": content_type})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["message"].startswith(message) and error["code"] == "invalid_request"


def test_utf8_form_text_passes_in_either_encoding(closed):
    """The same non-ASCII prompt, as UTF-8 multipart and as percent-encoded urlencoded form, passes validation
    (the closed gateway's 429); so does a file part whose bytes are not UTF-8, which is not text."""
    fox = "Fuchs im Schnee, 雪の中の狐"
    assert post(closed, "/v1/videos/sync", {**SMALL, "prompt": fox}).status_code == 429
    encoded = str(httpx.QueryParams({**SMALL, "prompt": fox})).encode()
    r = closed.client.post("/v1/videos/sync", content=encoded, headers={"content-type": URLENCODED})
    assert r.status_code == 429, r.text
    png = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 30, 30)).save(png, format="PNG")
    frame = ("f.png", png.getvalue(), "image/png")
    assert post(closed, "/v1/videos/sync", SMALL, input_reference=frame).status_code == 429


def test_form_text_is_checked_across_chunk_boundaries():
    """FormText, fed a multipart body one byte at a time (a character and a header split between chunks), passes
    valid UTF-8, names the field and offset of a bad byte, and leaves file parts alone."""
    from client.http.body import FormText
    from client.http.errors import GatewayError

    def feed(body: bytes) -> None:
        check = FormText(MULTIPART.encode())
        for i in range(len(body)):
            check.feed(body[i:i + 1])

    feed(raw_multipart([(b"prompt", "雪の中の狐".encode()), (b"seed", b"1")]))
    feed(raw_multipart([(b"input_reference", b"\x89PNG\xff\xfe")], filename=b"f.png"))
    with pytest.raises(GatewayError) as exc:
        feed(raw_multipart([(b"seed", b"1"), (b"prompt", "雪の".encode() + b"\xe4\xb8" + b"x")]))
    assert exc.value.param == "prompt" and "byte 0xe4 at offset 6 " in exc.value.detail


@pytest.mark.parametrize("files", [
    [("seed", (None, "1")), ("seed", (None, "2"))],
    [("prompt", (None, "a fox")), ("prompt", (None, "a whale"))],
    [("input_reference", ("a.png", b"a", "image/png")), ("input_reference", ("b.png", b"b", "image/png"))],
])
def test_a_field_given_twice_is_refused(closed, files):
    """A field given twice (FastAPI would silently take the last) is a 400 naming it."""
    name = files[0][0]
    others = [(k, (None, v)) for k, v in SMALL.items() if k != name]
    r = closed.client.post("/v1/videos/sync", files=others + files)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == name and error["message"] == f"{name}: given 2 times; give each field once"


def test_an_oversized_first_frame_is_413(closed):
    """A first frame over REPLICADP_MAX_IMAGE_BYTES is a 413 naming input_reference, whether it fits the body
    limit (checked on the file) or not (refused by its Content-Length before it is read)."""
    for size in (5000, 4 * 1024 * 1024):
        r = post(closed, "/v1/videos/sync", SMALL, input_reference=("big.png", b"x" * size, "image/png"))
        assert r.status_code == 413, r.text
        assert r.json()["error"]["param"] == "input_reference"


def test_health_is_503_without_a_live_replica(closed, live, replicas):
    """/health is 503 on a Redis with no live replica and 200 listing them where they serve; /v1/models
    lists the served model."""
    r = closed.client.get("/health")
    assert r.status_code == 503 and r.json()["replicas"] == []
    ok = live.client.get("/health")
    assert ok.status_code == 200 and ok.json()["status"] == "ok" and ok.json()["replicas"] == replicas.names
    models = live.client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["tiny"]


def test_models_list_each_replicas_fast_path(live, replicas, redis_db):
    """/v1/models lists under the served model each live replica and its fast path: the session's replicas (no
    step cache) serve standard only, no fast path; one started with REPLICADP_CACHE=first-block serves fast with
    `first-block threshold=0.05`."""
    card, = live.client.get("/v1/models").json()["data"]
    assert sorted(card["replicas"], key=lambda r: r["name"]) == [
        {"name": n, "qualities": ["standard"], "fast_path": None, "loras": [], "fused": [], "recipe": None}
        for n in sorted(replicas.names)]
    url = redis_db()
    group = start_replicas(1, url, "http-fast", REPLICADP_CACHE="first-block")
    try:
        with gateway(url, "fast") as gw:
            card, = gw.client.get("/v1/models").json()["data"]
    finally:
        group.stop()
    assert card["id"] == "tiny" and card["replicas"] == [
        {"name": group.names[0], "qualities": ["standard", "fast"], "fast_path": "first-block threshold=0.05",
         "loras": [], "fused": [], "recipe": None}]


def test_past_the_queue_depth_requests_get_429(redis_db):
    """With --max-queue 1 and nothing taking requests, the first is queued and the next ones, async or sync,
    are refused with 429 and a Retry-After in seconds instead of queueing without bound."""
    with gateway(redis_db(), "full", "--max-queue", "1") as gw:
        assert post(gw, "/v1/videos", SMALL).status_code == 200
        for route in ("/v1/videos", "/v1/videos/sync"):
            r = post(gw, route, SMALL)
            assert r.status_code == 429, r.text
            assert int(r.headers["retry-after"]) >= 1 and r.json()["error"]["code"] == "queue_full"


def test_priority_and_user_place_the_job(redis_db):
    """The form's priority and user reach the queue: with nothing taking requests, a batch job and an interactive
    job wait in their priorities' lists, each carrying its user; a job without them waits at normal."""
    url = redis_db()
    with gateway(url, "placed") as gw:
        for fields in ({"priority": "batch", "user": "farm"}, {"priority": "interactive", "user": "alice"}, {}):
            assert post(gw, "/v1/videos", {**SMALL, **fields}).status_code == 200
    client = redis.Redis.from_url(url)
    users = [[json.loads(raw)["headers"].get("replicadp_user") for raw in client.lrange(key, 0, -1)]
             for key in queue_lists(model_queue())]
    assert users == [["alice"], [None], ["farm"]]


def test_gateways_share_jobs_and_a_queued_job_is_cancelled(redis_db):
    """Two gateways on one Redis: a job created through one is read, listed and deleted through the other;
    deleting a queued job cancels it (no replica will run it), and a sync request that times out is a 504
    whose request is cancelled too."""
    url = redis_db()
    with gateway(url, "a", "--sync-timeout", "1") as a, gateway(url, "b") as b:
        job = post(a, "/v1/videos", SMALL).json()
        assert b.client.get(f"/v1/videos/{job['id']}").json()["status"] == "queued"
        assert [j["id"] for j in b.client.get("/v1/videos").json()["data"]] == [job["id"]]
        assert b.client.delete(f"/v1/videos/{job['id']}").json()["deleted"] is True
        assert a.client.get(f"/v1/videos/{job['id']}").status_code == 404
        assert redis.Redis.from_url(url).exists(CANCEL_KEY + job["id"])
        timed_out = post(a, "/v1/videos/sync", SMALL)
        assert timed_out.status_code == 504 and timed_out.json()["error"]["code"] == "timeout"
        wait_for(lambda: len(redis.Redis.from_url(url).keys(CANCEL_KEY + "*")) == 2,
                 "both requests to be marked cancelled", timeout=10)


def test_deleting_a_running_job_stops_it(slow):
    """DELETE of a job in progress stops it at its next denoising step (its task ends RequestCancelled, long
    before it would have completed) and the replica serves the next request."""
    job = post(slow, "/v1/videos", LONG).json()
    running = wait_for(job_once(slow, job["id"], lambda j: j["progress"] > 0), f"job {job['id']} to make progress")
    assert running["status"] == "in_progress" and running["replica"]
    assert slow.client.delete(f"/v1/videos/{job['id']}").status_code == 200
    meta = wait_for(lambda: (m := result_meta(slow.redis_url, job["id"])) and m["status"] == RequestState.FAILURE and m,
                    f"job {job['id']} to fail")
    assert meta["result"]["exc_type"] == "RequestCancelled"
    assert post(slow, "/v1/videos/sync", SMALL).status_code == 200


def test_a_sync_client_that_goes_away_cancels_its_request(slow):
    """A sync request whose client disconnects is cancelled: no replica keeps computing a video nobody waits
    for (its task ends RequestCancelled)."""
    client = redis.Redis.from_url(slow.redis_url)
    before = set(client.keys("celery-task-meta-*"))
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{slow.url}/v1/videos/sync", files=multipart(LONG), timeout=3)

    def cancelled():
        metas = [json.loads(client.get(k)) for k in set(client.keys("celery-task-meta-*")) - before]
        return [m for m in metas if m["status"] == RequestState.FAILURE]

    ended = wait_for(cancelled, "the abandoned request to end")
    assert [m["result"]["exc_type"] for m in ended] == ["RequestCancelled"]


def test_the_openapi_schema_describes_the_api(closed):
    """/openapi.json lists every endpoint, and the sync route's multipart form with its fields."""
    schema = closed.client.get("/openapi.json").json()
    assert {"/v1/videos/sync", "/v1/videos", "/v1/videos/{video_id}", "/v1/videos/{video_id}/content",
            "/v1/models", "/health"} <= set(schema["paths"])
    body = schema["paths"]["/v1/videos/sync"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    form = schema["components"]["schemas"][body["$ref"].rsplit("/", 1)[1]]
    assert {"prompt", "size", "seconds", "fps", "model", "input_reference"} <= set(form["properties"])
    assert form["required"] == ["prompt"]


def test_schemathesis_finds_no_500(closed):
    """Requests generated from /openapi.json for every operation (30 per operation, against a gateway that
    refuses whatever passes validation, so that nothing is generated) never answer a 500."""
    api = schemathesis.openapi.from_url(f"{closed.url}/openapi.json")
    for found in api.get_all_operations():
        operation = found.ok()

        @given(case=operation.as_strategy())
        @settings(max_examples=30, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        def no_500(case):
            response = case.call()
            assert response.status_code != 500, f"{case.method} {case.formatted_path}: {response.text}"

        no_500()


# vllm-omni's form fields (docs/serving/videos_api.md) this gateway accepts, and those it refuses on purpose
# (docs/http.md, "Differences from vllm-omni"): each would change the video, and Wan2.2-TI2V-5B has no use for it
# (guidance_scale_2 and boundary_ratio are for two-expert models: tests/test_experts.py).
VLLM_OMNI_REFUSED = {"guidance_scale_2": "4.0", "boundary_ratio": "0.875", "flow_shift": "5.0",
                     "lora": '{"name": "x"}', "extra_params": "{}",
                     "image_reference": '{"image_url": "https://example.com/frame.png"}'}
VLLM_OMNI_JOB_FIELDS = {"id", "object", "model", "prompt", "status", "progress", "size", "seconds", "created_at",
                        "completed_at", "expires_at", "error", "inference_time_s", "stage_durations",
                        "peak_memory_mb"}


def test_every_vllm_omni_field_gets_vllm_omnis_answer(live):
    """A job created with every field of vllm-omni's form that replicadp takes completes with the job object
    vllm-omni answers (its fields, whole seconds, stage durations and peak memory), its content carries
    vllm-omni's headers, each field replicadp refuses on purpose is a 400 naming it, and a `quality` that is not
    standard or fast, or fast on replicas without a step cache, is a 400 naming `quality`."""
    png = io.BytesIO()
    Image.new("RGB", (64, 64), (20, 90, 200)).save(png, format="PNG")
    form = {"prompt": "a fox in snow", "model": "tiny", "seconds": "2", "fps": "4", "size": "64x64", "width": "64",
            "height": "64", "num_frames": "9", "num_inference_steps": "2", "guidance_scale": "4.5", "seed": "3",
            "negative_prompt": "blur", "user": "parity"}
    r = post(live, "/v1/videos", form, input_reference=("frame.png", png.getvalue(), "image/png"))
    assert r.status_code == 200, r.text
    done = wait_for(job_once(live, r.json()["id"], lambda j: j["status"] not in ("queued", "in_progress")),
                    "the job to finish", timeout=120)
    assert VLLM_OMNI_JOB_FIELDS <= set(done) and done["status"] == "completed", done
    assert (done["seconds"], done["num_frames"], done["size"]) == ("2", 9, "64x64")
    assert done["expires_at"] == done["completed_at"] + SETTINGS.store_ttl_s
    assert done["peak_memory_mb"] > 0 and done["stage_durations"]["inference"] == done["inference_time_s"]
    content = live.client.get(f"/v1/videos/{done['id']}/content")
    assert content.status_code == 200 and mp4_frames(content.content) == (9, 64, 64, 4.0)
    assert json.loads(content.headers["x-stage-durations"]) == done["stage_durations"]
    assert float(content.headers["x-peak-memory-mb"]) == done["peak_memory_mb"]
    assert (content.headers["x-model"], content.headers["x-request-id"]) == ("tiny", done["id"])
    for field, value in VLLM_OMNI_REFUSED.items():
        refused = post(live, "/v1/videos", {**SMALL, field: value})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field, refused.text
    # vllm-omni's `quality` is replicadp's choice of path: standard or fast, and fast only where every live
    # replica has a step cache (these have none).
    for value, why in (("high", "must be one of standard, fast"), ("fast", "not served here")):
        refused = post(live, "/v1/videos", {**SMALL, "quality": value})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "quality", refused.text
        assert why in refused.json()["error"]["message"], refused.text


def test_seconds_that_disagree_with_num_frames_are_refused(live):
    """seconds and num_frames given together must name the same length: which one was meant?"""
    r = post(live, "/v1/videos", {**SMALL, "seconds": "3", "fps": "4"})  # 13 frames, not SMALL's 9
    assert r.status_code == 400 and r.json()["error"]["param"] == "seconds", r.text


def test_content_of_an_unfinished_or_failed_job_says_why(slow):
    """The content of a running job is a 409 with a Retry-After; of a failed one, a 409 that carries its
    error."""
    job = post(slow, "/v1/videos", LONG).json()
    wait_for(job_once(slow, job["id"], lambda j: j["progress"] > 0), f"job {job['id']} to make progress")
    running = slow.client.get(f"/v1/videos/{job['id']}/content")
    assert running.status_code == 409 and running.headers["retry-after"] == "1", running.text
    redis.Redis.from_url(slow.redis_url).set(CANCEL_KEY + job["id"], 1)
    wait_for(job_once(slow, job["id"], lambda j: j["status"] == "failed"), f"job {job['id']} to fail")
    failed = slow.client.get(f"/v1/videos/{job['id']}/content")
    assert failed.status_code == 409 and "cancelled" in failed.json()["error"]["message"], failed.text


KEYS = ("key-alice-0123456789", "key-bob-9876543210")


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_api_keys_guard_v1_and_leave_health_open(redis_db, tmp_path):
    """With API keys (one given as an option, one in a file with a comment), /v1 answers 401 in OpenAI's error
    shape without a key or with a wrong one, and serves either key; /health and the schema stay open."""
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"# the team's key\n{KEYS[1]}\n\n")
    with gateway(redis_db(), "keys", "--api-key", KEYS[0], "--api-keys-file", str(keys_file)) as gw:
        for headers in ({}, auth("not-a-key"), {"Authorization": f"Basic {KEYS[0]}"}):
            r = gw.client.get("/v1/models", headers=headers)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", r.text
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert r.json()["error"]["type"] == "invalid_request_error"
        assert post(gw, "/v1/videos", SMALL).status_code == 401
        for key in KEYS:
            assert gw.client.get("/v1/models", headers=auth(key)).status_code == 200
        assert gw.client.get("/health").status_code == 503  # open: no replica, not 401
        assert gw.client.get("/openapi.json").status_code == 200


def test_each_api_key_sees_only_its_own_jobs(redis_db):
    """A job made with one key is listed, read, fetched and deleted only with that key: to the other key it does
    not exist (404), and its list is its own."""
    with gateway(redis_db(), "owners", "--api-key", KEYS[0], "--api-key", KEYS[1]) as gw:
        mine = gw.client.post("/v1/videos", files=multipart(SMALL), headers=auth(KEYS[0])).json()["id"]
        theirs = gw.client.post("/v1/videos", files=multipart(SMALL), headers=auth(KEYS[1])).json()["id"]
        for key, own, other in ((KEYS[0], mine, theirs), (KEYS[1], theirs, mine)):
            assert [j["id"] for j in gw.client.get("/v1/videos", headers=auth(key)).json()["data"]] == [own]
            assert gw.client.get(f"/v1/videos/{own}", headers=auth(key)).status_code == 200
            for route in (f"/v1/videos/{other}", f"/v1/videos/{other}/content"):
                assert gw.client.get(route, headers=auth(key)).status_code == 404
            assert gw.client.delete(f"/v1/videos/{other}", headers=auth(key)).status_code == 404
        assert gw.client.delete(f"/v1/videos/{mine}", headers=auth(KEYS[0])).json()["deleted"] is True
        assert gw.client.get(f"/v1/videos/{theirs}", headers=auth(KEYS[1])).json()["status"] == "queued"


def send(gw, request: dict, key: str | None = None) -> str:
    """POST /v1/videos of a request (helpers.lasting's), the job id."""
    r = gw.client.post("/v1/videos", files=multipart(form_of(request)), headers=auth(key) if key else None)
    assert r.status_code == 200, r.text
    return r.json()["id"]


def completed(gw, job_id: str, key: str | None = None) -> dict:
    return wait_for(lambda: (j := gw.client.get(f"/v1/videos/{job_id}", headers=auth(key) if key else None).json())
                    ["status"] == "completed" and j, f"{job_id} to complete")


def test_a_signed_link_reads_its_videos_files_without_the_key_and_nothing_else(slow):
    """Behind API keys, GET /links gives a completed job's MP4 and poster as links a `<video>` can read without a
    header: the same bytes, in ranges, for about LINK_S. A link is refused (401) for another job's file, another
    route, a changed or past expiry, or a key the gateway does not have; another key asking for the links gets
    404, as for the job. Without keys, the links are the plain paths."""
    with gateway(slow.redis_url, "links", "--api-key", KEYS[0], "--api-key", KEYS[1]) as gw:
        mine, theirs = (send(gw, lasting(0.2, seed=n), key=key) for n, key in enumerate(KEYS, 1))
        completed(gw, mine, key=KEYS[0])
        completed(gw, theirs, key=KEYS[1])
        asked = time.time()
        links = gw.client.get(f"/v1/videos/{mine}/links", headers=auth(KEYS[0])).json()
        assert asked + LINK_S <= links["expires_at"] <= asked + LINK_S + LINK_STEP_S + 1, links
        video = gw.client.get(f"/v1/videos/{mine}/content", headers=auth(KEYS[0])).content
        assert gw.client.get(links["content"]).content == video
        part = gw.client.get(links["content"], headers={"Range": "bytes=0-99"})
        assert part.status_code == 206 and part.content == video[:100]
        poster = gw.client.get(links["poster"])
        assert poster.status_code == 200 and poster.headers["content-type"] == "image/jpeg"
        path, expires = f"/v1/videos/{mine}/content", links["expires_at"]
        expired, _ = signed_link(KeyPolicy(KEYS[0], "alice"), path, now=asked - LINK_S - LINK_STEP_S - 60)
        for link, says in ((links["content"].replace(mine, theirs), "signature"),
                           (links["content"].replace(f"/{mine}/content", f"/{mine}"), "missing"),
                           (links["content"].replace(f"expires={expires}", f"expires={expires + LINK_STEP_S}"),
                            "signature"),
                           (expired, "expired"),
                           (signed_link(KeyPolicy("key-not-configured", "eve"), path)[0], "signature")):
            refused = gw.client.get(link)
            assert refused.status_code == 401 and says in refused.json()["error"]["message"], (link, refused.text)
        assert gw.client.delete(links["content"].replace("/content", "")).status_code == 401
        assert gw.client.get(f"/v1/videos/{mine}/links", headers=auth(KEYS[1])).status_code == 404
    keyless = send(slow, lasting(0.2, seed=3))
    completed(slow, keyless)
    assert slow.client.get(f"/v1/videos/{keyless}/links").json() == {
        "object": "video.links", "content": f"/v1/videos/{keyless}/content",
        "poster": f"/v1/videos/{keyless}/poster", "expires_at": None}


def test_a_bad_api_key_stops_the_gateway_from_starting(redis_db, tmp_path):
    """A keys-file line whose word after the key is no `name=`/`max_priority=` attribute (a key with a space, say)
    is refused at start (exit 2), naming the file and line, never the key (tests/test_tenants.py: the rest of the
    format)."""
    keys_file = tmp_path / "keys"
    keys_file.write_text("good-key-0123456789\nbad key\n")
    run = subprocess.run([REPLICADP, "serve-http", "--api-keys-file", str(keys_file)], capture_output=True,
                         text=True, env={**os.environ, "REDIS_URL": redis_db()}, timeout=60)
    assert run.returncode == 2 and f"{keys_file}:2" in run.stderr and "bad key" not in run.stderr, run.stderr


def gateway_pid(gw) -> int:
    """The PID of a gateway this process started (`gateway`): the child whose command line serves its port."""
    from helpers import parent_of

    port = gw.url.rsplit(":", 1)[1].encode()
    for proc in Path("/proc").iterdir():
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
            if b"serve-http" in args and port in args and parent_of(int(proc.name)) == os.getpid():
                return int(proc.name)
        except (OSError, ValueError):  # not a process, or one that has just ended
            continue
    raise LookupError(f"no gateway process of this test serves {gw.url}")


def test_a_graceful_stop_answers_sync_requests_in_time_or_hands_them_over_as_jobs(slow):
    """SIGTERM to a gateway (one of its own, in front of `slow`'s replica) with two sync requests in flight: the
    one that ends within the grace (REPLICADP_HTTP_SHUTDOWN_GRACE, 6 s) gets its video; the one still waiting then
    gets a 503 `shutting_down` with Retry-After and its job id, not a 500, and is not cancelled: it completes on
    the replica, and another gateway of the same Redis serves it as a job (completed, its MP4)."""
    import signal

    from helpers import queue_depth

    client = redis.Redis.from_url(slow.redis_url)
    before = set(client.keys("celery-task-meta-*"))

    def running() -> bool:
        metas = [json.loads(client.get(k)) for k in set(client.keys("celery-task-meta-*")) - before]
        return any(m["status"] in (RequestState.STARTED, RequestState.PROGRESS) for m in metas)

    short = form_of(lasting(1, prompt="ends within the grace"))
    outlasting = form_of(lasting(12, prompt="outlasts the grace"))
    with gateway(slow.redis_url, "stopping", REPLICADP_HTTP_SHUTDOWN_GRACE="6") as gw, ThreadPoolExecutor(2) as pool:
        def sync(form):
            return httpx.post(f"{gw.url}/v1/videos/sync", files=multipart(form), timeout=60)

        first = pool.submit(sync, short)
        wait_for(running, "the first sync request to run")
        second = pool.submit(sync, outlasting)  # waits in the queue behind the first (one replica)
        wait_for(lambda: queue_depth(client, SYNTHETIC) == 1, "the second sync request to be queued")
        os.kill(gateway_pid(gw), signal.SIGTERM)
        ended, handed_over = first.result(), second.result()
    assert ended.status_code == 200 and mp4_frames(ended.content)[0] == 5, ended.text
    assert handed_over.status_code == 503, handed_over.text
    error, job_id = handed_over.json()["error"], handed_over.headers["x-request-id"]
    assert error["code"] == "shutting_down" and error["type"] == "server_error"
    assert f"GET /v1/videos/{job_id}" in error["message"] and int(handed_over.headers["retry-after"]) > 0
    job = wait_for(job_once(slow, job_id, lambda j: j["status"] not in ("queued", "in_progress")),
                   f"job {job_id} to end")
    assert job["status"] == "completed" and job["prompt"] == "outlasts the grace", job
    content = slow.client.get(f"/v1/videos/{job_id}/content")
    assert content.status_code == 200 and mp4_frames(content.content)[0] == 5
