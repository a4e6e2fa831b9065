"""Fixtures: a real embedded Redis-protocol server and real replica processes running the tiny model.

Everything a test session starts lives under one temp folder and is stopped at the end, also on failure.
"""

import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

# Before anything imports replicadp_tasks.settings (read once): no hub, and state, model cache and
# outputs in a folder of the session's own, never the user's `replicadp up` state. Under pytest-xdist
# (`make test` runs workers in parallel) each worker's session folder lies inside the controller's, which
# removes them all at its end, and the workers share one model cache: the tiny model is built once a run.
if "PYTEST_XDIST_WORKER" in os.environ:
    RUN_DIR = Path(os.environ["REPLICADP_TESTS_RUN_DIR"])
    SESSION_DIR = Path(tempfile.mkdtemp(prefix=f"{os.environ['PYTEST_XDIST_WORKER']}-", dir=RUN_DIR))
else:
    RUN_DIR = SESSION_DIR = Path(tempfile.mkdtemp(prefix="replicadp-tests-"))
    os.environ["REPLICADP_TESTS_RUN_DIR"] = str(RUN_DIR)  # inherited by the xdist workers
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["REPLICADP_STATE_DIR"] = str(SESSION_DIR / "state")
os.environ["REPLICADP_MODEL_CACHE"] = str(RUN_DIR / "models")
os.environ["OUTPUT_DIR"] = str(SESSION_DIR / "outputs")
os.environ.pop("REDIS_URL", None)
# The temp files of every process the tests start, too: Celery's prefork pool keeps a pymp-* folder per replica,
# which a replica SIGKILLed by a fault test cannot remove. This process's as well (tempfile read TMPDIR above,
# once): torch.compile keeps its cache and precompiled headers under it (test_architectures compiles blocks).
(SESSION_DIR / "tmp").mkdir()
os.environ["TMPDIR"] = tempfile.tempdir = str(SESSION_DIR / "tmp")
# Before torch starts, as a replica does (determinism.py): the tests that compare frames across pipelines of one
# process depend on it as the replicas do. test_isolation proves that a replica sets it with nothing inherited.
from replicadp_tasks.model import determinism  # noqa: E402

determinism.set_environment()

import pytest  # noqa: E402
import redis  # noqa: E402

from client.api import use_redis  # noqa: E402
from client.local.embedded import EmbeddedServer  # noqa: E402
from client.local.replicas import Replicas, tail  # noqa: E402


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """tmp_path folders under the session folder too, unless --basetemp says otherwise: two runs at once on one
    machine (two checkouts) share /tmp/pytest-of-<user> (seen: one run's folder removed under the other's
    tests)."""
    if config.option.basetemp is None:
        config.option.basetemp = str(SESSION_DIR / "pytest")


# Tests that use these start replicas, or the servers and models that replicas need: marked `cluster` and left
# out of `make quick`. A test that starts replicas without one of them says so with @pytest.mark.cluster; in every
# run, start_replicas refuses to start replicas for a test not so marked, so that the quick loop stays quick.
CLUSTER_FIXTURES = {"redis_db", "redis_server", "replicas", "tiny_model", "clean_env", "s3_server"}
# The files that take minutes go to the xdist workers first, longest first (seconds measured in a `make test` run,
# docs/testing.md), so that none of them starts last and keeps the run waiting on one worker.
LONGEST_FIRST = ["test_faults.py", "test_failover.py", "test_layouts.py", "test_parallel.py", "test_isolation.py",
                 "test_preemption.py", "test_fewstep.py", "test_fleet.py",
                 "test_gpu_check.py", "test_adapters.py", "test_webhooks.py", "test_ui.py", "test_step_cache.py",
                 "test_cli.py", "test_ops.py", "test_http.py", "test_jobs.py", "test_embedded.py", "test_bench.py",
                 "test_hostile.py", "test_scheduling.py", "test_architectures.py", "test_stopped.py",
                 "test_client.py", "test_admission.py"]
_RUNNING = {"cluster": False, "since": 0.0}  # whether the test being set up now is marked `cluster`; since when


def pytest_collection_modifyitems(config, items):
    for item in items:
        if CLUSTER_FIXTURES & set(item.fixturenames):
            item.add_marker("cluster")
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its order


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before the test's fixtures, module-scoped ones included, are set up."""
    _RUNNING["cluster"] = item.get_closest_marker("cluster") is not None
    _RUNNING["since"] = time.time()


LOG_TAIL_LINES = 80


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed cluster test's report ends with the last lines of each log (replicas, gateways, moto) written since
    it was set up: CI keeps the report, not the session folder, and a failure that shows once in many runs needs
    them."""
    report = (yield).get_result()
    if report.failed and item.get_closest_marker("cluster") is not None:
        for log in sorted((SESSION_DIR / "logs").glob("*.log")):
            if log.stat().st_mtime >= _RUNNING["since"]:
                report.sections.append((f"{log.name}, last {LOG_TAIL_LINES} lines", tail(log, LOG_TAIL_LINES)))


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(SESSION_DIR, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_server():
    """A fresh embedded Valkey (password, 127.0.0.1, append-only): clean before the session, gone after.
    This process's Celery app points at its DB 0."""
    server = EmbeddedServer(SESSION_DIR / "redis")
    use_redis(server.start())
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_db(redis_server):
    """Hands out databases on the session's server: each `redis_db()` is the URL of one that no test has had
    in this session, empty, so that a test's queue, results and counters are its own. DB 0 stays the session
    replicas' and this process's."""
    numbers = itertools.count(1)

    def fresh() -> str:
        url = f"{redis_server.url.rsplit('/', 1)[0]}/{next(numbers)}"
        redis.Redis.from_url(url).flushdb()  # past the server's `databases`: "DB index is out of range"
        return url

    return fresh


@pytest.fixture(scope="session")
def tiny_model():
    """The tiny Wan2.2-TI2V-style model, built once into the session's model cache."""
    from replicadp_tasks.model import resolve_model

    return Path(resolve_model("tiny", Path(os.environ["REPLICADP_MODEL_CACHE"])))


@pytest.fixture(scope="session")
def model_cache(tiny_model):
    """The session's model cache, with every tiny stand-in built in it (tiny, tiny-wan2.1, tiny-a14b, ...)."""
    from replicadp_tasks.model import TINY_SPECS, resolve_model

    for spec in TINY_SPECS:
        resolve_model(spec, tiny_model.parent)
    return tiny_model.parent


def start_replicas(n: int, redis_url: str, name: str, model: str = "tiny", first: int = 0, **env) -> Replicas:
    """`n` replicas (one CPU thread each) of `model` on `redis_url`, numbered from `first`, started and serving;
    `env`: their settings."""
    if not _RUNNING["cluster"]:
        raise RuntimeError(f"replicas {name!r} started by a test not marked cluster: mark it @pytest.mark.cluster")
    return Replicas(n, redis_url=redis_url, model=model, threads=1, env=env, first=first,
                    log_path=SESSION_DIR / "logs" / f"{name}.log").start(timeout=180)


def run_client_on(url: str, requests: list[dict], concurrency: int, timeout: float = 60) -> list[SimpleNamespace]:
    """run_requests in a client process of its own on `url` (another DB): this process's Celery app stays on
    the session's DB 0. Outcomes in input order; `timeout`: seconds per request."""
    code = ("import json, sys; from client.api import run_requests; print(json.dumps([o.__dict__ for o in "
            "run_requests(json.loads(sys.argv[1]), concurrency=int(sys.argv[2]), timeout=float(sys.argv[3]))]))")
    run = subprocess.run([sys.executable, "-c", code, json.dumps(requests), str(concurrency), str(timeout)],
                         env={**os.environ, "REDIS_URL": url}, capture_output=True, text=True, timeout=timeout + 60)
    assert run.returncode == 0, run.stderr
    return sorted((SimpleNamespace(**o) for o in json.loads(run.stdout)), key=lambda o: o.index)


@pytest.fixture(scope="session")
def replicas(redis_server, tiny_model):
    """Two replicas (one CPU thread each) serving the tiny model from DB 0, shared by the session, with a
    resource budget (128x128, 17 frames, 30 steps) so that random valid requests stay cheap."""
    group = start_replicas(2, redis_server.url, "replicas", REPLICADP_MAX_WORK=str(128 * 128 * 17 * 30))
    yield group
    group.stop()


@pytest.fixture
def clean_env(tmp_path):
    """For a `replicadp` command that starts servers of its own (up, demo): an environment with no REDIS_URL, its
    own state folder and its own TMPDIR, whose processes test_embedded.started_with finds (and checks gone)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env.update(TMPDIR=str(tmp), REPLICADP_STATE_DIR=str(tmp_path / "state"))
    return env, tmp


# moto's server (`python -m moto.server`), but serving one request at a time: moto checks a conditional put's
# If-None-Match and then writes, with no lock between, so that on its threaded server two puts of one key at once
# can both succeed (seen under load: test_s3's racing puts), which S3 itself never allows. One at a time, each
# check-and-write is atomic, as S3's are.
MOTO_ONE_REQUEST_AT_A_TIME = (
    "import os, sys; from werkzeug.serving import run_simple; "
    "from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app; "
    "os.environ['MOTO_PORT'] = sys.argv[2]; "
    "run_simple(sys.argv[1], int(sys.argv[2]), DomainDispatcherApplication(create_backend_app), threaded=False, "
    "request_handler=MotoRequestHandler)")


@pytest.fixture(scope="session")
def s3_server():
    """moto's standalone S3 server (one request at a time), a process of its own on 127.0.0.1 and a free port,
    spoken to over HTTP (boto3
    with its endpoint URL); stopped after the session. It takes any credentials: this process, and the replicas,
    clients and gateways it starts from now on, get test ones through boto3's own variables, and its endpoint URL
    (REPLICADP_S3_ENDPOINT_URL; this process read its SETTINGS before: in here, pass `.url`)."""
    from client.local.embedded import _free_port, die_with_parent
    from helpers import wait_for
    from replicadp_tasks.outputs.store import new_s3_client

    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    port = _free_port()
    (SESSION_DIR / "logs").mkdir(parents=True, exist_ok=True)
    with open(SESSION_DIR / "logs" / "moto.log", "ab") as log:
        proc = subprocess.Popen([sys.executable, "-c", MOTO_ONE_REQUEST_AT_A_TIME, "127.0.0.1", str(port)], stdout=log,
                                stderr=subprocess.STDOUT, preexec_fn=die_with_parent)  # noqa: PLW1509 (as Replicas)
    url = os.environ["REPLICADP_S3_ENDPOINT_URL"] = f"http://127.0.0.1:{port}"
    client = new_s3_client(url)

    def answers() -> bool:
        assert proc.poll() is None, f"moto exited ({proc.returncode}): see {SESSION_DIR / 'logs' / 'moto.log'}"
        try:
            return client.list_buckets() is not None
        except Exception:  # noqa: BLE001 (not listening yet)
            return False

    try:
        wait_for(answers, "moto's S3 server to answer")
        yield SimpleNamespace(url=url, client=client)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def s3_bucket(s3_server):
    """A bucket of this test's own on the session's S3 server."""
    import uuid

    name = f"test-{uuid.uuid4().hex[:16]}"
    s3_server.client.create_bucket(Bucket=name)
    return name
