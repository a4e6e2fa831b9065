"""A fleet of models in one deployment (issue #56): each request names its model (or takes the default) and lands
only on replicas of that model, through Python, HTTP, the CLI and Celery's own CLI; a killed replica's request is
redone by a replica of its own model; priorities hold within each model, and one model's backlog holds up no other;
one model's replicas all down leave its requests waiting while the other model serves on; and the isolation
protocol holds on a batch of both models."""

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import redis
from conftest import SESSION_DIR, run_client_on, start_replicas
from helpers import SYNTHETIC, declare, lasting, model_queue, parent_of, queue_depth, wait_for, wait_for_step
from test_http import gateway, multipart

from client.api import _app_for
from replicadp_tasks.cluster import connection
from replicadp_tasks.cluster.fleet import Fleet
from replicadp_tasks.contract import InvalidRequest
from replicadp_tasks.contract.keys import ATTEMPTS_KEY

REPLICADP = str(Path(sys.executable).parent / "replicadp")
CELERY = str(Path(sys.executable).parent / "celery")
SMALL = {"height": 64, "width": 64, "num_frames": 9, "num_inference_steps": 4}
SHORT = lasting(0.5, prompt="short")


def cli(url: str, *args: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([REPLICADP, *args], env={**os.environ, "REDIS_URL": url, **env}, capture_output=True,
                          text=True, timeout=600)


# --- two synthetic models, `final` (2 replicas) and `draft` (1): the faults and the waits ---------------------

@pytest.fixture(scope="module")
def synthetic(redis_db):
    """The synthetic backend served under two names on a database of its own: `final` by replica0 and replica1,
    `draft` by replica2."""
    url = redis_db()
    final = start_replicas(2, url, "fleet-final", model=SYNTHETIC, REPLICADP_SERVED_MODEL_NAME="final")
    try:
        draft = start_replicas(1, url, "fleet-draft", model=SYNTHETIC, first=2, REPLICADP_SERVED_MODEL_NAME="draft")
    except BaseException:
        final.stop()
        raise
    yield SimpleNamespace(url=url, final=final, draft=draft, app=_app_for(url), redis=redis.Redis.from_url(url))
    draft.stop()
    final.stop()


def send(fleet, model: str | None, request: dict):
    return fleet.app.send_task("replicadp.generate", kwargs={**request, **({"model": model} if model else {})})


def test_each_request_lands_on_a_replica_of_its_model(synthetic):
    """Requests of both models sent at once: each is made by a replica of the model it names, and says so."""
    results = [(model, send(synthetic, model, {**SHORT, "seed": s})) for s in range(4) for model in ("final", "draft")]
    for model, result in results:
        meta = result.get(timeout=60)
        names = synthetic.final.names if model == "final" else synthetic.draft.names
        assert meta["model"] == model and meta["replica"] in names, (model, meta["replica"])


def test_a_killed_replicas_request_is_redone_by_a_replica_of_its_own_model(synthetic):
    """SIGKILL of the main process of the `final` replica running a request, its supervisor held: the request
    goes back to `final`'s queue and the other `final` replica completes it; the idle `draft` replica, which
    sweeps dead holders too, never takes it."""
    result = send(synthetic, "final", lasting(3, prompt="redo me on final", seed=5))
    info = wait_for_step(synthetic, result.id, 2)
    main = parent_of(info["pid"])
    supervisor = parent_of(main)
    os.kill(supervisor, signal.SIGSTOP)
    try:
        os.kill(main, signal.SIGKILL)
        meta = result.get(timeout=90)
    finally:
        os.kill(supervisor, signal.SIGCONT)
    assert meta["model"] == "final" and meta["replica"] in synthetic.final.names
    assert meta["replica"] != info["replica"]
    assert int(synthetic.redis.get(ATTEMPTS_KEY + result.id)) == 2
    wait_for(lambda: set(synthetic.final.names) <= synthetic.final.serving(), "the killed replica to serve again",
             timeout=120)


def test_priorities_hold_within_each_model_and_one_models_backlog_holds_no_other(synthetic):
    """`draft`'s one replica busy with a long request: a batch request for `draft`, then an interactive one, wait,
    and the interactive one is served first; a batch request for `final`, sent after both, completes while `draft`'s
    replica still runs its long request: it never waited behind `draft`'s queue."""
    busy = send(synthetic, "draft", lasting(6, prompt="busy"))
    wait_for_step(synthetic, busy.id, 1)
    batch = send(synthetic, "draft", {**SHORT, "priority": "batch", "seed": 1})
    interactive = send(synthetic, "draft", {**SHORT, "priority": "interactive", "seed": 2})
    final = send(synthetic, "final", {**SHORT, "priority": "batch", "seed": 3})
    assert final.get(timeout=60)["model"] == "final"
    assert not busy.ready()
    for result in (busy, batch, interactive):
        assert result.get(timeout=60)["model"] == "draft"
    done = {name: synthetic.app.AsyncResult(r.id).date_done for name, r in (("batch", batch),
                                                                           ("interactive", interactive))}
    assert done["interactive"] < done["batch"], done


def test_a_request_naming_another_model_is_refused_by_the_replica_it_reaches(synthetic):
    """A request for `draft` sent to `final`'s queue by hand (Celery's `queue` option wins over the router) is
    failed by the `final` replica that takes it, naming `model`; that replica serves on."""
    wrong = synthetic.app.send_task("replicadp.generate", kwargs={**SHORT, "model": "draft"},
                                    queue=model_queue("final"))
    with pytest.raises(InvalidRequest, match="model='draft': this replica serves 'final'"):
        wrong.get(timeout=60)
    assert send(synthetic, "final", SHORT).get(timeout=60)["model"] == "final"


def test_the_default_model_and_a_model_not_served(synthetic):
    """With two models served, a request naming none is refused naming both, in Python (InvalidRequest, nothing
    sent), the CLI (exit 2, naming --model) and over HTTP (400 model_not_found); REPLICADP_DEFAULT_MODEL picks
    one; a model the deployment does not serve is refused the same ways; a model with live replicas cannot be
    forgotten."""
    with pytest.raises(InvalidRequest, match=r"model: none given, and this deployment serves draft, final"):
        send(synthetic, None, SHORT)
    with pytest.raises(InvalidRequest, match=r"model='nope': not served here; this deployment serves draft, final"):
        send(synthetic, "nope", SHORT)
    [defaulted] = run_client_on_env(synthetic.url, [{**SHORT, "seed": 3}], REPLICADP_DEFAULT_MODEL="draft")
    assert defaulted["ok"] and defaulted["result"]["model"] == "draft", defaulted
    run = cli(synthetic.url, "generate", "x", "--size", "64x64", "--num-frames", "5", "--steps", "2",
              "--model", "nope")
    assert run.returncode == 2 and "--model" in run.stderr and "draft, final" in run.stderr, run.stderr
    run = cli(synthetic.url, "forget-model", "final")
    assert run.returncode == 1 and "still served: 2 live replica(s)" in run.stderr, run.stderr
    with gateway(synthetic.url, "fleet-refusals") as gw:
        for form in ({"prompt": "x"}, {"prompt": "x", "model": "nope"}):
            r = gw.client.post("/v1/videos", files=multipart(form))
            assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_found", r.text
            assert r.json()["error"]["param"] == "model" and "draft, final" in r.json()["error"]["message"]


def run_client_on_env(url: str, requests: list[dict], **env) -> list[dict]:
    """run_requests in a process of its own on `url` with `env`: its outcomes' fields, in input order."""
    code = ("import json, sys; from client.api import run_requests; print(json.dumps([o.__dict__ for o in "
            "run_requests(json.loads(sys.argv[1]), timeout=60)]))")
    run = subprocess.run([sys.executable, "-c", code, json.dumps(requests)], capture_output=True, text=True,
                         env={**os.environ, "REDIS_URL": url, **env}, timeout=120)
    assert run.returncode == 0, run.stderr
    return sorted(json.loads(run.stdout), key=lambda o: o["index"])


def test_celery_call_with_a_model_kwarg_is_routed(synthetic):
    """Celery's own CLI (`celery call`), whose producer loads celeryconfig and so its router, sends a request naming
    `draft` to `draft`'s queue."""
    kwargs = json.dumps({**SHORT, "model": "draft", "request_id": "from-celery-call"})
    run = subprocess.run([CELERY, "-A", "replicadp_tasks", "call", "replicadp.generate", "--kwargs", kwargs],
                         env={**os.environ, "REDIS_URL": synthetic.url}, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    meta = synthetic.app.AsyncResult(run.stdout.strip()).get(timeout=60)
    assert meta["model"] == "draft" and meta["replica"] in synthetic.draft.names


def test_a_models_requests_wait_while_its_replicas_are_down_and_the_other_serves_on(synthetic):
    """`final`'s replicas stopped (which takes back the declaration their start made) and `final` declared as a
    deployment's REPLICADP_MODELS does: its requests wait in its queue (status and /v1/models say so: 0 replicas,
    3 waiting), `draft`'s complete meanwhile; once `final`'s replicas are back, its requests complete on them."""
    synthetic.final.stop()
    try:
        with pytest.raises(InvalidRequest, match="model='final': not served here; this deployment serves draft"):
            send(synthetic, "final", SHORT)
        declare(synthetic.url, "final")
        waiting = [send(synthetic, "final", {**SHORT, "seed": s}) for s in range(3)]
        done = [send(synthetic, "draft", {**SHORT, "seed": s}) for s in range(3)]
        assert all(r.get(timeout=60)["model"] == "draft" for r in done)
        assert all(r.state == "PENDING" for r in waiting)
        assert queue_depth(synthetic.redis, "final") == 3
        run = cli(synthetic.url, "status", "--json")
        assert run.returncode == 0, run.stderr
        models = {m["name"]: m for m in json.loads(run.stdout)["models"]}
        assert (models["final"]["replicas"], models["final"]["queue_depth"]) == (0, 3), models
        assert (models["draft"]["serving"], models["draft"]["queue_depth"]) == (1, 0), models
        with gateway(synthetic.url, "fleet-waiting") as gw:
            cards = {c["id"]: c for c in gw.client.get("/v1/models").json()["data"]}
            assert (cards["final"]["replicas"], cards["final"]["queue_depth"]) == ([], 3), cards
            assert [r["name"] for r in cards["draft"]["replicas"]] == synthetic.draft.names
    finally:
        synthetic.final.start(timeout=180)
    assert all(r.get(timeout=60)["replica"] in synthetic.final.names for r in waiting)


# --- two tiny models, the real pipeline: tiny (replica0) and tiny-a14b (replica1) --------------------------------

@pytest.fixture(scope="module")
def pair(redis_db, model_cache):
    """One replica of `tiny` and one of `tiny-a14b` (two experts) on a database of their own."""
    url = redis_db()
    out = str(SESSION_DIR / "outputs-fleet")
    one = start_replicas(1, url, "fleet-tiny", model="tiny", OUTPUT_DIR=out)
    try:
        two = start_replicas(1, url, "fleet-a14b", model="tiny-a14b", first=1, OUTPUT_DIR=out)
    except BaseException:
        one.stop()
        raise
    yield SimpleNamespace(url=url, replica={"tiny": one.names[0], "tiny-a14b": two.names[0]})
    two.stop()
    one.stop()


def test_a_mixed_batch_through_python_http_and_the_cli(pair, tmp_path):
    """Requests for tiny and tiny-a14b, mixed: through Python, the gateway (sync, and /v1/models listing both with
    their replica) and `replicadp submit` (a JSONL naming both), each video is made by its model's replica and
    the Result names the model; `replicadp status` shows both models, each with its one replica."""
    mixed = [{**SMALL, "prompt": f"a fox {i}", "seed": i, "model": model}
             for i, model in enumerate(["tiny", "tiny-a14b"] * 2)]
    for outcome in run_client_on(pair.url, mixed, concurrency=4, timeout=120):
        assert outcome.ok, outcome.error
        asked = outcome.request["model"]
        assert (outcome.result["model"], outcome.result["replica"]) == (asked, pair.replica[asked])

    with gateway(pair.url, "fleet-pair") as gw:
        cards = {c["id"]: c for c in gw.client.get("/v1/models").json()["data"]}
        assert {m: [r["name"] for r in c["replicas"]] for m, c in cards.items()} == \
            {m: [name] for m, name in pair.replica.items()}
        for model in pair.replica:
            form = {"prompt": "a heron", "size": "64x64", "num_frames": "9", "num_inference_steps": "4",
                    "model": model}
            r = httpx.post(f"{gw.url}/v1/videos/sync", files=multipart(form), timeout=120)
            assert r.status_code == 200, r.text
            assert (r.headers["x-model"], r.headers["x-replica"]) == (model, pair.replica[model])

    batch = tmp_path / "mixed.jsonl"
    batch.write_text("".join(json.dumps({**SMALL, "prompt": f"a crane {i}", "model": model}) + "\n"
                             for i, model in enumerate(["tiny-a14b", "tiny", "tiny", "tiny-a14b"])))
    run = cli(pair.url, "submit", str(batch))
    assert run.returncode == 0, run.stdout + run.stderr
    lines = [json.loads(line) for line in (tmp_path / "mixed.jsonl.results.jsonl").read_text().splitlines()]
    asked = {n: json.loads(line)["model"] for n, line in enumerate(batch.read_text().splitlines(), 1)}
    assert len(lines) == 4 and all(line["ok"] for line in lines)
    for line in lines:
        model = asked[line["line"]]
        assert (line["result"]["model"], line["result"]["replica"]) == (model, pair.replica[model])

    run = cli(pair.url, "status", "--json")
    assert run.returncode == 0, run.stderr
    models = {m["name"]: m for m in json.loads(run.stdout)["models"]}
    assert {m: (row["replicas"], row["serving"]) for m, row in models.items()} == {m: (1, 1) for m in pair.replica}


def test_isolation_protocol_on_a_mixed_model_batch(pair, tmp_path):
    """The isolation protocol on both models at once: 16 inputs alternating tiny and tiny-a14b, recorded one at a
    time, then replayed at concurrency 4 (both replicas computing at once): each of the 16 matches its own
    model's baseline bit for bit, and the report has each model's share."""
    baseline, report = tmp_path / "baseline.json", tmp_path / "mixed.json"
    common = ["bench", "--num-requests", "16", "--size", "64x64", "--num-frames", "9", "--steps", "4",
              "--model", "tiny", "--model", "tiny-a14b", "--warmup", "0"]
    run = cli(pair.url, *common, "--concurrency", "1", "--write-baseline", str(baseline))
    assert run.returncode == 0, run.stdout + run.stderr
    run = cli(pair.url, *common, "--concurrency", "4", "--check-baseline", str(baseline), "--json", str(report))
    assert run.returncode == 0, run.stdout + run.stderr
    rep = json.loads(report.read_text())
    iso = rep["isolation"]
    assert (iso["matched"], iso["mismatched"], iso["passed"]) == (16, 0, True), iso["mismatches"]
    assert {m: (share["completed"], share["replicas"]) for m, share in rep["per_model"].items()} == \
        {m: (8, [name]) for m, name in pair.replica.items()}


def test_a_producer_waits_for_a_first_declaration_and_then_refuses(redis_db):
    """A producer on a deployment that declares no model yet (its first replica is starting) waits for the first
    declaration instead of refusing at once, and routes by it; with none in its patience, it refuses naming
    `model`."""
    url = redis_db()
    waiting = Fleet(connection.client(url), (), None, patience_s=30)
    timer = threading.Timer(1.0, declare, (url, "late"))
    timer.start()
    try:
        assert waiting.choose(None) == "late"
    finally:
        timer.cancel()
    impatient = Fleet(connection.client(redis_db()), (), None, patience_s=1)
    with pytest.raises(InvalidRequest, match="none given, and this deployment serves none yet"):
        impatient.choose(None)
