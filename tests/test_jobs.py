"""A job as a person follows it (docs/ui.md): the phases its replica reports, its place in the queue, a delete that
says `cancelling` until the replica stops and leaves no video, and a poster of its first frame. Real gateways in
front of synthetic replicas whose denoising and decoding last as long as a test sets."""

import io
import json
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import redis
from conftest import start_replicas
from helpers import SYNTHETIC, lasting, wait_for
from PIL import Image
from test_cli import cli
from test_http import LONG, SMALL, form_of, gateway, job_once, post, result_meta, slow  # noqa: F401 (fixtures)

from client.api import InFlight
from client.http.waits import cost_model
from client.progress import flight_text
from replicadp_tasks.contract import Phase, RequestState
from replicadp_tasks.contract.keys import JOB_KEY, POSTER_KEY
from replicadp_tasks.outputs import decode_mp4

# The decoding replica's decode: long enough to be seen, to delete a job in, and for four CLI processes started at
# once to read it on a loaded 2-core machine (each takes a second or two to import what it needs).
DECODE_S = 10


@pytest.fixture(scope="module")
def decoding(redis_db):
    """One synthetic replica that decodes for DECODE_S after its last step, storing into a folder of its own,
    behind a gateway; `.output` is the folder."""
    url = redis_db()
    output = Path(tempfile.mkdtemp(prefix="decoding-"))
    group = start_replicas(1, url, "synthetic-decoding", model=f"{SYNTHETIC}:{DECODE_S}", OUTPUT_DIR=str(output))
    try:
        with gateway(url, "decoding") as gw:
            gw.output = output
            yield gw
    finally:
        group.stop()
        shutil.rmtree(output, ignore_errors=True)


def reports(url: str):
    """A subscription to every record a replica writes (Celery publishes each one it stores), from now on."""
    pubsub = redis.Redis.from_url(url).pubsub()
    pubsub.psubscribe("celery-task-meta-*")
    return pubsub


def drain(pubsub, task_id: str, until: float = 30.0) -> list[dict]:
    """The records of `task_id` published until its final one (or `until` seconds without a message)."""
    seen = []
    while True:
        message = pubsub.get_message(timeout=until)
        if message is None:
            return seen
        if message["type"] == "pmessage" and message["channel"].decode().endswith(task_id):
            seen.append(json.loads(message["data"]))
            if seen[-1]["status"] in (RequestState.SUCCESS, RequestState.FAILURE):
                return seen


def test_a_job_goes_through_each_phase_and_says_how_long_it_is_in_it(decoding):
    """The replica reports denoising at steps, then decoding, encoding and storing, in that order, each with when it
    began; the job shows the phase with its step and its time in it (the decode, DECODE_S long, is seen as it
    runs, and /v1/status says the same of the running request, with its prompt); the completed job says how long
    it took from its creation."""
    sub = reports(decoding.redis_url)
    job_id = post(decoding, "/v1/videos", form_of(lasting(1, prompt="through the phases"))).json()["id"]
    job = wait_for(job_once(decoding, job_id, lambda j: j["phase"] == "decoding"), "the job to be decoding")
    assert job["status"] == "in_progress" and job["step"] == job["total_steps"] == 4 and job["progress"] == 99
    assert 0 <= job["phase_elapsed_s"] < DECODE_S + 1 and job["elapsed_s"] >= job["phase_elapsed_s"]
    running = wait_for(lambda: decoding.client.get("/v1/status").json()["replicas"][0]["running"],
                       "the replica to show the request")
    assert (running["id"], running["prompt"], running["phase"]) == (job_id, "through the phases", "decoding")
    later = wait_for(job_once(decoding, job_id, lambda j: j["phase"] != "decoding" or j["phase_elapsed_s"] >= 1.5),
                     "time to pass in the decode")  # the phase's time counts up while it lasts
    assert later["phase"] != "decoding" or later["phase_elapsed_s"] > job["phase_elapsed_s"]
    done = wait_for(job_once(decoding, job_id, lambda j: j["status"] == "completed"), "the job to complete")
    assert done["phase"] == "completed" and done["progress"] == 100 and done["elapsed_s"] >= DECODE_S
    # Every record the replica wrote, in order: its phases, each once, each begun after the one before.
    records = drain(sub, job_id)
    progress = [r["result"] for r in records if r["status"] == RequestState.PROGRESS]
    phases = [p["phase"] for i, p in enumerate(progress) if i == 0 or progress[i - 1]["phase"] != p["phase"]]
    assert phases == [Phase.DENOISING, Phase.DECODING, Phase.ENCODING, Phase.STORING], phases
    starts = {p["phase"]: p["phase_started_at"] for p in progress}
    assert starts[Phase.ENCODING] - starts[Phase.DECODING] >= DECODE_S * 0.9
    assert starts[Phase.DENOISING] <= starts[Phase.DECODING] <= starts[Phase.ENCODING] <= starts[Phase.STORING]
    assert records[-1]["status"] == RequestState.SUCCESS
    assert decoding.client.get("/v1/status").json()["replicas"][0]["running"] is None


def test_queued_jobs_show_their_place_in_the_queue_by_priority(slow):
    """Behind a running request, queued jobs show their place (1 = next), counting the higher priorities first:
    an interactive job sent last goes first, a batch one sent before it stays last; a job that starts has no
    place any more."""
    running = post(slow, "/v1/videos", LONG).json()["id"]
    wait_for(job_once(slow, running, lambda j: j["status"] == "in_progress"), "the long one to start")
    sent = {}
    for name, priority in [("n1", "normal"), ("n2", "normal"), ("b", "batch"), ("i", "interactive")]:
        sent[name] = post(slow, "/v1/videos", {**SMALL, "prompt": name, "priority": priority}).json()["id"]
    try:
        def read():  # the gateway reads the queue's order at most once a second: the newest may not be in it yet
            jobs = {name: slow.client.get(f"/v1/videos/{i}").json() for name, i in sent.items()}
            return all(j["queue_position"] for j in jobs.values()) and jobs

        places = wait_for(read, "every queued job to have a place")
        assert {n: j["queue_position"] for n, j in places.items()} == {"i": 1, "n1": 2, "n2": 3, "b": 4}, places
        assert all(j["phase"] == "queued" and j["priority"] == p for j, p in
                   zip(places.values(), ["normal", "normal", "batch", "interactive"]))
        listed = {j["id"]: j["queue_position"] for j in slow.client.get("/v1/videos").json()["data"]}
        assert listed[sent["b"]] == 4 and listed[running] is None
        assert slow.client.get(f"/v1/videos/{running}").json()["queue_position"] is None
    finally:  # the queued ones first: while the long one runs, none of them can start
        for job_id in [*sent.values(), running]:
            slow.client.delete(f"/v1/videos/{job_id}")
    assert all(slow.client.get(f"/v1/videos/{i}").status_code == 404 for i in sent.values())  # queued: forgotten
    wait_for(job_once(slow, running, lambda j: j["phase"] == "cancelled"), "the running one to end cancelled")


def test_a_job_deleted_during_its_decode_is_cancelling_then_cancelled_and_leaves_no_video(decoding):
    """DELETE during the decode (which no step check can stop): the job leaves the list at once, GET says
    `cancelling` while the replica decodes, then cancelled; the replica does not store the video (no file in its
    folder, the request fails RequestCancelled) and serves the next request."""
    job_id = post(decoding, "/v1/videos", form_of(lasting(1, prompt="deleted in the decode"))).json()["id"]
    wait_for(job_once(decoding, job_id, lambda j: j["phase"] == "decoding"), "the job to be decoding")
    assert decoding.client.delete(f"/v1/videos/{job_id}").json()["deleted"] is True
    job = decoding.client.get(f"/v1/videos/{job_id}").json()
    assert (job["status"], job["phase"]) == ("in_progress", "cancelling"), job
    assert job_id not in [j["id"] for j in decoding.client.get("/v1/videos").json()["data"]]
    ended = wait_for(job_once(decoding, job_id, lambda j: j["status"] != "in_progress"), "the replica to stop")
    assert (ended["status"], ended["phase"], ended["error"]["code"]) == ("failed", "cancelled", "cancelled"), ended
    meta = result_meta(decoding.redis_url, job_id)
    assert meta["status"] == RequestState.FAILURE and meta["result"]["exc_type"] == "RequestCancelled"
    assert "not stored" in meta["result"]["exc_message"][0], meta
    assert not list(decoding.output.glob(f"{job_id}*")), list(decoding.output.iterdir())
    assert decoding.client.delete(f"/v1/videos/{job_id}").json()["deleted"] is True  # now forgotten
    assert decoding.client.get(f"/v1/videos/{job_id}").status_code == 404
    assert post(decoding, "/v1/videos/sync", form_of(lasting(0.5))).status_code == 200


def test_a_video_stored_as_its_job_was_deleted_is_removed_when_the_job_is_read(decoding):
    """The gateway's side of a cancel that came as the replica stored (after the replica's last check): a job
    marked deleted while it ran whose request then succeeded reads cancelled, and its video is removed from the
    store, not left until retention. (The mark is written here as DELETE writes it, on a job that completed.)"""
    job_id = post(decoding, "/v1/videos", form_of(lasting(0.5, prompt="stored as deleted"))).json()["id"]
    wait_for(job_once(decoding, job_id, lambda j: j["status"] == "completed"), "the job to complete", timeout=60)
    assert list(decoding.output.glob(f"{job_id}*"))
    client = redis.Redis.from_url(decoding.redis_url)
    record = json.loads(client.get(JOB_KEY + job_id))
    client.set(JOB_KEY + job_id, json.dumps({**record, "cancelled_at": record["admitted_at"] + 1}))
    job = decoding.client.get(f"/v1/videos/{job_id}").json()
    assert (job["status"], job["phase"], job["error"]["code"]) == ("failed", "cancelled", "cancelled"), job
    assert not list(decoding.output.glob(f"{job_id}*")), list(decoding.output.iterdir())
    assert decoding.client.get(f"/v1/videos/{job_id}/content").status_code == 409


def test_a_poster_is_the_videos_first_frame_small_and_kept(slow):
    """GET /v1/videos/{id}/poster of a completed job is a JPEG of its first frame (the video's size, aspect kept,
    under POSTER_PX), made once and kept in Redis; it and the MP4 say a browser may keep them; a job that is not
    completed has no poster (409)."""
    queued = post(slow, "/v1/videos", LONG).json()["id"]
    assert slow.client.get(f"/v1/videos/{queued}/poster").status_code == 409
    slow.client.delete(f"/v1/videos/{queued}")
    job_id = post(slow, "/v1/videos", {**SMALL, "size": "64x112", "prompt": "a tall one"}).json()["id"]
    wait_for(job_once(slow, job_id, lambda j: j["status"] == "completed"), "the job to complete")
    poster = slow.client.get(f"/v1/videos/{job_id}/poster")
    assert poster.status_code == 200 and poster.headers["content-type"] == "image/jpeg"
    image = Image.open(io.BytesIO(poster.content))
    assert image.format == "JPEG" and image.size == (64, 112)  # width x height: portrait stays portrait
    content = slow.client.get(f"/v1/videos/{job_id}/content")
    first = decode_mp4(content.content)[0].astype(int)  # the synthetic backend's frames are flat colours
    assert abs(np.asarray(image.convert("RGB")).astype(int) - first).mean() < 4
    assert "immutable" in poster.headers["cache-control"] and poster.headers["etag"]
    assert redis.Redis.from_url(slow.redis_url).get(POSTER_KEY + job_id) == poster.content
    assert slow.client.get(f"/v1/videos/{job_id}/poster").content == poster.content
    assert "immutable" in content.headers["cache-control"] and content.headers["etag"] != poster.headers["etag"]
    slow.client.delete(f"/v1/videos/{job_id}")
    assert redis.Redis.from_url(slow.redis_url).get(POSTER_KEY + job_id) is None


def test_the_cli_says_the_phase_past_the_last_step(decoding):
    """During the decode, `replicadp get` and `replicadp status` (table and --json) say `decoding`, as the job does,
    where they said the step before. The four commands run at once, inside the decode (checked after them)."""
    job_id = post(decoding, "/v1/videos", form_of(lasting(1, prompt="seen from the CLI"))).json()["id"]
    wait_for(job_once(decoding, job_id, lambda j: j["phase"] == "decoding"), "the job to be decoding")
    commands = {"get --json": ("get", job_id, "--json"), "get": ("get", job_id), "status --json": ("status", "--json"),
                "status": ("status",)}
    with ThreadPoolExecutor(len(commands)) as pool:
        runs = {name: pool.submit(cli, *args, redis_url=decoding.redis_url) for name, args in commands.items()}
        out = {name: run.result().stdout for name, run in runs.items()}
    after = decoding.client.get(f"/v1/videos/{job_id}").json()
    assert after["phase"] == "decoding", f"the decode ended before the commands did; make DECODE_S longer: {after}"
    got = json.loads(out["get --json"])
    assert (got["status"], got["phase"], got["step"]) == ("running", "decoding", 4), got
    assert f"{job_id}: running on {got['replica']}, decoding" in out["get"]
    snap = json.loads(out["status --json"])
    assert (snap["replicas"][0]["request_id"], snap["replicas"][0]["phase"]) == (job_id, "decoding"), snap
    assert "decoding" in out["status"]
    wait_for(job_once(decoding, job_id, lambda j: j["status"] == "completed"), "the job to complete")


def test_the_progress_line_shows_the_phase_past_the_last_step():
    """The bar's text for requests in flight (`submit`, `bench`): the step while denoising, the phase after."""
    flying = [InFlight(None, RequestState.PROGRESS, Phase.DENOISING, 3, 30, "r0"),
              InFlight(None, RequestState.PROGRESS, Phase.DECODING, 30, 30, "r1")]
    assert flight_text(flying) == "[r0 3/30] [r1 decoding]"


def test_the_cost_of_a_request_is_fitted_to_recent_jobs_of_several_sizes():
    """The page's estimate (waits.cost_model): a fixed part and a part per megapixel-frame-step, fitted to recent
    jobs; through the origin when they are all of one size; never a negative part."""
    fitted = cost_model([(50, 7.0), (100, 12.0), (400, 42.0)])
    assert fitted.fixed_s == pytest.approx(2.0, abs=0.01) and fitted.per_unit_s == pytest.approx(0.1, abs=1e-3)
    assert (fitted.min_units, fitted.max_units) == (50, 400)
    one_size = cost_model([(395, 40.0), (395, 42.0)])
    assert one_size.fixed_s == 0 and one_size.per_unit_s == pytest.approx(41 / 395)
    noisy = cost_model([(1, 3.0), (4, 2.0)])  # bigger yet faster: no slope to trust
    assert (noisy.fixed_s, noisy.per_unit_s) == (2.5, 0.0)
    assert cost_model([]) is None
