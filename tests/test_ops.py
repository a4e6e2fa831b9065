"""Operations: the compose file, Flower behind basic auth, the Prometheus exporter, the per-replica health
check, and replicas on separate hosts (network namespaces) against one Redis."""

import base64
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace

import pytest
import redis
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from client.api import _app_for, live_replicas
from client.local.embedded import EmbeddedServer, die_with_parent, stop_pid
from client.ops.flower import CredentialsError, credentials
from client.ops.metrics import Exporter
from client.local.replicas import LAUNCHER, stop_group
from conftest import SESSION_DIR, run_client_on, start_replicas
from helpers import SYNTHETIC, declare, declared, lasting, model_queue, wait_for
from replicadp_tasks.cluster import connection
from replicadp_tasks.contract.keys import REPLICA_KEY
from replicadp_tasks.contract import RequestState
from replicadp_tasks.settings import SETTINGS
from replicadp_tasks.outputs import fetch_video

ROOT = Path(__file__).resolve().parent.parent
REPLICADP = str(Path(sys.executable).parent / "replicadp")
TINY = {"prompt": "x", "height": 64, "width": 64, "num_frames": 5, "num_inference_steps": 2}
# On the lone replica (synthetic backend): long enough to span a few replica heartbeats (2 s apart).
LONG = lasting(8, prompt="long")
# Easy to catch mid-request, short enough to finish soon once resumed.
STEPPED = lasting(4, prompt="stepped")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, auth: str | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url)
    if auth:
        req.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def start(args: list[str], url: str, **env) -> subprocess.Popen:
    """A `replicadp` command in the background on `url`, ended with this process at the latest."""
    return subprocess.Popen([REPLICADP, *args], env={**os.environ, "REDIS_URL": url, **env}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)


def stop(proc: subprocess.Popen) -> None:
    """End a process this test started, by its PID."""
    stop_pid(proc.pid)
    proc.wait()
    proc.stdout.close()


# --- docker-compose.yml ----------------------------------------------------------------------------------

WORKER_COMMAND = ["celery", "-A", "replicadp_tasks", "worker"]


def docker_compose() -> str | None:
    """docker-compose v1: `make install-test` puts PyPI's 1.29.2 in .venv/compose; else one on PATH."""
    local = ROOT / ".venv" / "compose" / "bin" / "docker-compose"
    return str(local) if local.exists() else shutil.which("docker-compose")


def check_services(services: dict) -> None:
    """Each worker reserves GPUs no other worker has, under its own replica name, and checks its health under
    that name."""
    workers = {n: s for n, s in services.items() if s.get("command", [])[:4] == WORKER_COMMAND}
    assert len(workers) >= 2
    gpus = {}
    for name, svc in workers.items():
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        gpus[name] = [i for d in devices for i in d["device_ids"]]
        assert gpus[name] and all("gpu" in d["capabilities"] for d in devices), name
        replica = svc["command"][svc["command"].index("-n") + 1]
        assert svc["healthcheck"]["test"][-2:] == ["--replica", replica], name
    every = [i for ids in gpus.values() for i in ids]
    assert len(every) == len(set(every)), f"a GPU reserved twice: {gpus}"
    names = [s["command"][s["command"].index("-n") + 1] for s in workers.values()]
    assert len(names) == len(set(names)), names


def published_ips(services: dict) -> dict:
    """service -> host addresses of its published ports (short or long syntax, as `config` prints either)."""
    out = {}
    for name, svc in services.items():
        for port in svc.get("ports", []):
            ip = port.get("host_ip", "0.0.0.0") if isinstance(port, dict) else str(port).rsplit(":", 2)[0]
            out.setdefault(name, []).append(ip)
    return out


def test_compose_file_gives_each_worker_its_own_gpu():
    """The file as written (PyYAML, no docker-compose needed): one GPU per worker, never shared, and each
    worker's healthcheck asks about its own replica."""
    check_services(yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"])


@pytest.fixture
def compose_dir(tmp_path):
    """A project folder: the compose file, .env from .env.example, the Dockerfile (the build context)."""
    for name in ("docker-compose.yml", "Dockerfile"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copy(ROOT / ".env.example", tmp_path / ".env")
    return tmp_path


def compose_config(project: Path, *files: str) -> subprocess.CompletedProcess:
    exe = docker_compose()
    if exe is None:
        pytest.skip("docker-compose v1 is not installed: `make install-test` installs it into .venv/compose")
    return subprocess.run([exe, *(a for f in files for a in ("-f", f)), "config"], cwd=project, capture_output=True,
                          text=True, timeout=60)


def test_compose_config_validates_and_keeps_redis_on_loopback(compose_dir):
    """`docker-compose config` (no Docker engine needed) accepts the file with .env.example; in the resolved
    config each worker has its own GPU, Redis runs append-only with a password, the gateway reads its keys from
    ./api-keys as a secret and answers only loopback names, and nothing is published beyond 127.0.0.1. Without
    .env it refuses, naming REDIS_PASSWORD."""
    run = compose_config(compose_dir)
    assert run.returncode == 0, run.stderr
    services = yaml.safe_load(run.stdout)["services"]
    check_services(services)
    assert {ip for ips in published_ips(services).values() for ip in ips} == {"127.0.0.1"}
    assert "redis" in published_ips(services)
    command = services["redis"]["command"]
    command = command if isinstance(command, str) else " ".join(command)
    assert "--appendonly yes" in command and "--requirepass change-me" in command
    assert services["worker-gpu0"]["environment"]["REDIS_URL"].startswith("redis://:change-me")
    # The gateway: its keys file as a secret (./api-keys by default), answering only the names it is reached by.
    gateway = services["gateway"]
    keys_at = gateway["command"][gateway["command"].index("--api-keys-file") + 1]
    assert keys_at == "/run/secrets/api-keys" and gateway["secrets"] == [{"source": "api-keys"}]
    assert run.stdout.count(str(compose_dir / "api-keys")) == 1
    assert gateway["environment"]["REPLICADP_ALLOWED_HOSTS"] == "localhost 127.0.0.1"
    (compose_dir / ".env").unlink()
    run = compose_config(compose_dir)
    assert run.returncode != 0 and "REDIS_PASSWORD" in run.stderr


def test_the_ha_overlay_puts_every_service_behind_three_sentinels(compose_dir):
    """docker-compose.ha.yml over docker-compose.yml validates: two replicas follow `redis`, three Sentinels watch
    them (config written once, into a volume each), every data server refuses writes without a replica
    (min-replicas-to-write), and every replicadp service (both workers, flower, the gateway, the exporter) gets
    one Sentinel URL that replicadp parses: three Sentinels, the master's name, a password for each side."""
    shutil.copy(ROOT / "docker-compose.ha.yml", compose_dir)
    run = compose_config(compose_dir, "docker-compose.yml", "docker-compose.ha.yml")
    assert run.returncode == 0, run.stderr
    services = yaml.safe_load(run.stdout)["services"]
    check_services(services)
    assert {"redis-replica-1", "redis-replica-2", "sentinel-1", "sentinel-2", "sentinel-3"} <= set(services)
    for name in ("redis", "redis-replica-1", "redis-replica-2"):
        assert "--min-replicas-to-write 1" in services[name]["command"], name
    for name in ("redis-replica-1", "redis-replica-2"):
        assert "--replicaof redis 6379" in services[name]["command"]
    for name in ("sentinel-1", "sentinel-2", "sentinel-3"):
        script = services[name]["command"][-1]
        assert "sentinel monitor replicadp redis 6379 2" in script and script.startswith("[ -f /data/sentinel.conf ]")
    apps = [n for n, s in services.items() if s.get("image") == "replicadp:latest"]
    assert sorted(apps) == ["flower", "gateway", "metrics", "worker-gpu0", "worker-gpu1"]
    urls = {services[n]["environment"]["REDIS_URL"] for n in apps}
    assert len(urls) == 1
    target = connection.parse(urls.pop())
    assert target.sentinels == (("sentinel-1", 26379), ("sentinel-2", 26379), ("sentinel-3", 26379))
    password = "change-me-to-a-long-random-hex-string"  # .env.example's
    assert (target.master, target.password, target.sentinel_password) == ("replicadp", password, password)


def test_adding_a_gpu_is_one_copied_block(compose_dir):
    """Copying the worker-gpu1 block and changing its index gives a third worker on GPU 2 that validates."""
    path = compose_dir / "docker-compose.yml"
    text = path.read_text()
    block = re.search(r"\n  worker-gpu1:\n.*?\n\n", text, re.S).group(0)
    third = block.replace("gpu1", "gpu2").replace("replica1", "replica2").replace('["1"]', '["2"]')
    path.write_text(text.replace(block, block + third.lstrip("\n")))
    run = compose_config(compose_dir)
    assert run.returncode == 0, run.stderr
    services = yaml.safe_load(run.stdout)["services"]
    check_services(services)
    assert services["worker-gpu2"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == ["2"]


# --- Flower -----------------------------------------------------------------------------------------------

def test_flower_credentials_come_from_the_environment_or_are_generated():
    """FLOWER_BASIC_AUTH is used as given; unset or empty, a password is generated; a malformed value is
    refused without echoing it."""
    assert credentials({"FLOWER_BASIC_AUTH": "ops:s3cret"}) == ("ops:s3cret", False)
    auth, generated = credentials({"FLOWER_BASIC_AUTH": ""})
    assert generated and auth.startswith("admin:") and len(auth) > 20
    with pytest.raises(CredentialsError) as exc:
        credentials({"FLOWER_BASIC_AUTH": "ops:ok,justapassword"})
    assert "entry 2" in str(exc.value) and "justapassword" not in str(exc.value)


def test_flower_requires_basic_auth_and_shows_the_replicas(replicas, redis_server):
    """`replicadp flower` prints a generated password once, keeps it off its command line, answers /api/workers
    with 401 without or with wrong credentials, and with them 200 listing both replicas."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "FLOWER_BASIC_AUTH"}
    proc = subprocess.Popen([REPLICADP, "flower", "--port", str(port)], env={**env, "REDIS_URL": redis_server.url},
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
    try:
        line = proc.stdout.readline()
        assert "generated, shown once" in line, line
        auth = line.split()[-1]
        assert auth.split(":")[1] not in Path(f"/proc/{proc.pid}/cmdline").read_text()
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: _answers(base), "Flower to listen")
        assert http_get(f"{base}/api/workers")[0] == 401
        assert http_get(f"{base}/api/workers", "admin:wrong")[0] == 401

        def lists_replicas():
            status, body = http_get(f"{base}/api/workers?refresh=1", auth)
            assert status == 200, body
            return set(replicas.names) <= set(json.loads(body))

        wait_for(lists_replicas, "Flower to list both replicas")
    finally:
        stop(proc)


def test_flower_metrics_require_basic_auth(redis_db):
    """Flower's /metrics (which Flower itself serves to anyone) answers 401 without or with wrong credentials
    and its Prometheus text with them (FLOWER_BASIC_AUTH as given); /healthcheck stays open for probes."""
    port = free_port()
    env = {**os.environ, "REDIS_URL": redis_db(), "FLOWER_BASIC_AUTH": "ops:s3cret"}
    proc = subprocess.Popen([REPLICADP, "flower", "--port", str(port)], env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: _answers(base), "Flower to listen")
        assert http_get(f"{base}/metrics")[0] == 401
        assert http_get(f"{base}/metrics", "ops:wrong")[0] == 401
        status, body = http_get(f"{base}/metrics", "ops:s3cret")
        assert status == 200 and "flower_" in body.decode(), body[:300]
        assert http_get(f"{base}/healthcheck") == (200, b"OK")
    finally:
        stop(proc)


def _answers(base: str) -> bool:
    try:
        http_get(base + "/healthcheck")
        return True
    except OSError:
        return False


# --- a replica of its own: the exporter's counts and the health check's faults touch no other test's ------

@pytest.fixture(scope="module")
def lone_replica(redis_db):
    """One replica of the synthetic backend (its requests run for the time a test sets) on a database of its
    own: its counts are exact, and stopping its process or its consumer disturbs no other test."""
    url = redis_db()
    group = start_replicas(1, url, "lone", model=SYNTHETIC)
    yield SimpleNamespace(url=url, name=group.names[0], app=_app_for(url))
    group.stop()


# --- Prometheus exporter ----------------------------------------------------------------------------------

def scrape(port: int) -> dict:
    """{(name, labels as a sorted tuple): value} from the exporter's /metrics."""
    status, body = http_get(f"http://127.0.0.1:{port}/metrics")
    assert status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(body.decode()) for s in fam.samples}


def busy(metrics: dict) -> dict:
    return {dict(labels)["replica"]: v for (n, labels), v in metrics.items() if n == "replicadp_replica_busy"}


def start_exporter(url: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = start(["metrics", "--port", str(port)], url)
    wait_for(lambda: _answers(f"http://127.0.0.1:{port}"), "the exporter to listen")
    return proc, port


def test_metrics_count_and_time_the_requests(lone_replica):
    """With the exporter running, 3 requests that succeed and 1 that fails (invalid) are counted under the
    replica's name; each success has a latency, each start a queue wait; afterwards the queue is empty."""
    name = lone_replica.name
    proc, port = start_exporter(lone_replica.url)
    try:
        # The replica's heartbeat arrives once the exporter's event consumer is in place.
        wait_for(lambda: name in busy(scrape(port)), "the exporter to see the replica")
        requests = [{**TINY, "seed": s} for s in range(3)] + [{**TINY, "num_frames": 6}]  # the last is invalid
        outcomes = run_client_on(lone_replica.url, requests, concurrency=2)
        assert [o.ok for o in outcomes] == [True, True, True, False]

        def counted():
            m = scrape(port)
            labels = (("replica", name),)
            ends = (m.get(("replicadp_requests_completed_total", labels)),
                    m.get(("replicadp_requests_failed_total", labels)))
            return m if ends == (3, 1) else None

        m = wait_for(counted, "the exporter to count the 4 requests")
        assert m[("replicadp_request_latency_seconds_count", ())] == 3
        assert m[("replicadp_queue_wait_seconds_count", ())] == 4
        assert 0 < m[("replicadp_request_latency_seconds_sum", ())] < 3 * 60
        synthetic = (("model", SYNTHETIC),)
        assert m[("replicadp_queue_depth", synthetic)] == 0
        assert m[("replicadp_queue_next_age_seconds", synthetic)] == 0
        assert m[("replicadp_redis_up", ())] == 1
    finally:
        stop(proc)


@pytest.mark.parametrize("order", [("sent", "started", "succeeded"), ("started", "succeeded", "sent")])
def test_metrics_time_each_request_once_whatever_the_event_order(order):
    """The producer publishes task-sent after the request itself, so a replica's started and succeeded events can
    arrive first: either way the queue wait (sent to started) and the latency (sent to succeeded) are observed
    once each."""
    registry = CollectorRegistry()
    exporter = Exporter(registry)
    at = {"sent": 100.0, "started": 100.25, "succeeded": 101.5}
    for kind in order:
        exporter.on_event({"type": f"task-{kind}", "uuid": "u1", "hostname": "replica0@h", "timestamp": at[kind],
                           "local_received": time.time(), "clock": 1})
    assert registry.get_sample_value("replicadp_queue_wait_seconds_count") == 1
    assert registry.get_sample_value("replicadp_queue_wait_seconds_sum") == 0.25
    assert registry.get_sample_value("replicadp_request_latency_seconds_count") == 1
    assert registry.get_sample_value("replicadp_request_latency_seconds_sum") == 1.5
    assert registry.get_sample_value("replicadp_requests_completed_total", {"replica": "replica0@h"}) == 1


def test_metrics_show_a_replica_busy_while_it_runs(lone_replica):
    """replicadp_replica_busy is 1 for a replica while it runs a request (of 8 s), 0 before and after, and its
    model's replicadp_requests_running (from the heartbeats) 1, then 0."""
    proc, port = start_exporter(lone_replica.url)
    model = (("model", SYNTHETIC),)

    def state(m: dict) -> tuple:
        return busy(m), m.get(("replicadp_requests_running", model))

    try:
        wait_for(lambda: state(scrape(port)) == ({lone_replica.name: 0.0}, 0), "the replica to be idle")
        result = lone_replica.app.send_task("replicadp.generate", kwargs=LONG)
        wait_for(lambda: state(scrape(port)) == ({lone_replica.name: 1.0}, 1), "the replica to be busy")
        result.get(timeout=120)
        wait_for(lambda: state(scrape(port)) == ({lone_replica.name: 0.0}, 0), "the replica to be idle again")
    finally:
        stop(proc)


def test_metrics_show_the_queue_depth_and_how_long_it_waited(redis_db):
    """With no replica on its DB, two sent requests wait: depth 2, one at each priority they were sent with, none
    running, and the age of the next (the interactive one) is the time since it was sent."""
    url = redis_db()
    declare(url, "tiny")
    proc, port = start_exporter(url)
    try:
        first = time.time()
        for seed, priority in enumerate(("batch", "interactive")):
            _app_for(url).send_task("replicadp.generate", kwargs={**TINY, "seed": seed, "priority": priority})
        time.sleep(1.0)  # the wait to be measured
        m = scrape(port)
        tiny = (("model", "tiny"),)
        assert m[("replicadp_queue_depth", tiny)] == 2
        assert m[("replicadp_requests_running", tiny)] == 0  # declared, no replica yet: 0, not absent
        assert {dict(labels)["priority"]: v for (n, labels), v in m.items()
                if n == "replicadp_queue_depth_by_priority"} == {"interactive": 1, "normal": 0, "batch": 1}
        # Waited at least the pause since the last was sent, at most the time since the first (one clock here).
        assert 1.0 <= m[("replicadp_queue_next_age_seconds", tiny)] <= time.time() - first
    finally:
        stop(proc)


# --- health -----------------------------------------------------------------------------------------------

STALL = 2.0  # --stall-after in these tests


def health(replica, url: str) -> tuple[int, str]:
    run = subprocess.run([REPLICADP, "health", "--replica", replica, "--stall-after", str(STALL), "--timeout", "3"],
                         env={**os.environ, "REDIS_URL": url}, capture_output=True, text=True, timeout=60)
    return run.returncode, run.stdout.strip()


@pytest.fixture
def stopped(lone_replica):
    """SIGSTOP a process of the lone replica (its pool child); SIGCONT it whatever the test does."""
    pids = []

    def stop_process(pid):
        pids.append(pid)
        os.kill(pid, signal.SIGSTOP)

    yield stop_process
    for pid in pids:
        os.kill(pid, signal.SIGCONT)


def test_health_passes_a_serving_replica_and_fails_an_absent_one(lone_replica):
    """An idle replica that consumes the queue is healthy (exit 0); a name nobody answers to is not (exit 1)."""
    code, line = health("replica0@%h", lone_replica.url)  # %h expands as in `celery worker -n`
    assert (code, line) == (0, f"healthy: {lone_replica.name}: idle, consuming {model_queue(SYNTHETIC)!r}")
    code, line = health("nobody@nowhere", lone_replica.url)
    assert code == 1 and "no reply to ping" in line


def test_redis_url_option_wins_over_the_environment(lone_replica):
    """--redis-url points a command at its Redis before anything connects, ahead of REDIS_URL (unreachable
    here): `health` and `status` both find the replica there."""
    env = {**os.environ, "REDIS_URL": "redis://127.0.0.1:1/0"}
    for args in (["health", "--replica", lone_replica.name], ["status"]):
        run = subprocess.run([REPLICADP, *args, "--redis-url", lone_replica.url], env=env, capture_output=True,
                             text=True, timeout=60)
        assert run.returncode == 0 and lone_replica.name in run.stdout, run.stdout + run.stderr


def test_health_fails_a_request_stuck_at_one_step(lone_replica, stopped):
    """A pool child that stops mid-request (SIGSTOP: the main process still answers pings) is healthy when
    first seen at its step, and unhealthy once the step has not moved for --stall-after seconds."""
    result = lone_replica.app.send_task("replicadp.generate", kwargs=STEPPED)
    meta = wait_for(lambda: (lambda m: m if m["status"] == RequestState.PROGRESS else None)(
        lone_replica.app.backend.get_task_meta(result.id)), "the request to run", interval=0.01)
    stopped(meta["result"]["pid"])
    code, line = health(lone_replica.name, lone_replica.url)
    assert code == 0 and f"running request {result.id}" in line, line
    time.sleep(STALL + 0.5)  # the stall to be detected
    code, line = health(lone_replica.name, lone_replica.url)
    assert code == 1 and f"request {result.id} has been at step" in line and "(stuck)" in line, line


def test_health_fails_an_idle_replica_beside_waiting_requests(lone_replica, stopped):
    """Alive but not consuming: with its pool child stopped while idle, the replica answers pings and reports
    nothing running, while a request waits in the queue; past --stall-after that is unhealthy. Resumed, it
    runs both requests and is healthy again."""
    wait_for(lambda: ": idle," in health(lone_replica.name, lone_replica.url)[1], "the replica to be idle")
    # The pool child, as the replica published it when it loaded the model.
    pid = json.loads(redis.Redis.from_url(lone_replica.url).get(REPLICA_KEY + lone_replica.name))["pid"]
    stopped(pid)
    # The main process takes the first from the queue and hands it to the stopped child; the second waits.
    results = [lone_replica.app.send_task("replicadp.generate", kwargs={**TINY, "seed": s}) for s in range(2)]
    time.sleep(STALL + 0.5)  # the stall to be detected
    code, line = health(lone_replica.name, lone_replica.url)
    assert code == 1 and any(f"idle while request {r.id} has waited" in line for r in results), line
    os.kill(pid, signal.SIGCONT)
    assert all(r.get(timeout=60)["replica"] == lone_replica.name for r in results)
    assert health(lone_replica.name, lone_replica.url)[0] == 0


def test_health_fails_a_replica_that_lost_its_queue_consumer(lone_replica):
    """A replica whose consumer of its model's queue was cancelled (what a broker reconnect can leave) is
    unhealthy; given the consumer back, healthy."""
    control = lone_replica.app.control
    assert control.cancel_consumer(model_queue(SYNTHETIC), destination=[lone_replica.name], reply=True)
    try:
        code, line = health(lone_replica.name, lone_replica.url)
        assert code == 1 and f"not consuming queue {model_queue(SYNTHETIC)!r}" in line, line
    finally:
        assert control.add_consumer(model_queue(SYNTHETIC), destination=[lone_replica.name], reply=True)
    assert health(lone_replica.name, lone_replica.url)[0] == 0


# --- several hosts ----------------------------------------------------------------------------------------

@pytest.fixture
def two_hosts():
    """Two network namespaces ("hosts"), each joined to this one by a veth pair on its own /24; skipped unless
    this process may create them (root, iproute2)."""
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("unshare"):
        pytest.skip("needs root, iproute2 and unshare to create network namespaces")
    # On one machine (a Firecracker VM, kernel 6.18, AMD EPYC) the replicas in the namespaces loaded their model but
    # never showed as serving, on 7628823 too; on the next (the same kernel, Intel Xeon) it passed 4 runs of 4.
    # Opt in until that is understood: its failure then carries the replicas' logs.
    if os.environ.get("REPLICADP_TEST_NETNS") != "1":
        pytest.skip("set REPLICADP_TEST_NETNS=1 to run it (it fails on some VMs, cause unknown)")
    tag = f"rdp{os.getpid() % 100000}"
    hosts = []
    try:
        for i in range(2):
            ns, here, there, net = f"{tag}h{i}", f"{tag}a{i}", f"{tag}b{i}", f"10.231.{i}"
            add = subprocess.run(["ip", "netns", "add", ns], capture_output=True, text=True)
            if add.returncode != 0:
                pytest.skip(f"cannot create a network namespace here: {add.stderr.strip()}")
            hosts.append(SimpleNamespace(ns=ns, name=f"host{'ab'[i]}", gateway=f"{net}.1"))
            for cmd in (f"link add {here} type veth peer name {there} netns {ns}", f"addr add {net}.1/24 dev {here}",
                        f"link set {here} up", f"-n {ns} addr add {net}.2/24 dev {there}", f"-n {ns} link set {there} up",
                        f"-n {ns} link set lo up"):
                subprocess.run(["ip", *cmd.split()], check=True, capture_output=True)
        yield hosts
    finally:
        for host in hosts:  # deleting a namespace deletes its veth end, and the pair with it
            subprocess.run(["ip", "netns", "del", host.ns], capture_output=True)


def test_replicas_on_two_hosts_share_one_redis(two_hosts, tiny_model, tmp_path):
    """A replica on each of two hosts (separate network namespaces and host names, no route to this host's
    loopback) needs only REDIS_URL and the Redis output store: both serve requests from the one queue, and the
    client fetches every video."""
    with ExitStack() as stack:
        server = EmbeddedServer(tmp_path / "redis", also_bind=tuple(h.gateway for h in two_hosts))
        url = server.start()
        stack.callback(server.stop)
        for host in two_hosts:
            probe = subprocess.run(["ip", "netns", "exec", host.ns, sys.executable, "-c",
                                    f"import socket; socket.create_connection(('127.0.0.1', {server.port}), 2)"],
                                   capture_output=True)
            assert probe.returncode != 0  # this host's loopback is not reachable from there
            env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                   "REDIS_URL": f"redis://:{server.password}@{host.gateway}:{server.port}/0", "REPLICADP_STORE": "redis",
                   "REPLICADP_MODEL": "tiny", "NUM_REPLICAS": "1", "DEVICES": "cpu", "THREADS_PER_REPLICA": "1"}
            (SESSION_DIR / "logs").mkdir(exist_ok=True)
            log = open(SESSION_DIR / "logs" / f"{host.name}.log", "ab")
            stack.callback(log.close)
            # Its own host name too (a UTS namespace), so its replica is replica0@<host>, as on another machine.
            proc = subprocess.Popen(["ip", "netns", "exec", host.ns, "unshare", "--uts", "sh", "-c",
                                     'hostname "$0" && exec bash "$@"', host.name, str(LAUNCHER), "--loglevel", "INFO"],
                                    env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    preexec_fn=die_with_parent)
            stack.callback(stop_group, proc.pid, 60, proc)
        want = {f"replica0@{h.name}" for h in two_hosts}
        try:
            wait_for(lambda: want <= set(live_replicas(timeout=0.5, url=url)), "both hosts' replicas to serve",
                     timeout=180)
        except TimeoutError as exc:  # what the replicas said: the cause, on a machine where this fails
            tails = {h.name: (SESSION_DIR / "logs" / f"{h.name}.log").read_text()[-3000:] for h in two_hosts}
            raise AssertionError(f"{exc}\n" + "\n".join(f"--- {n} ---\n{t}" for n, t in tails.items())) from None
        outcomes = run_client_on(url, [{**TINY, "seed": s} for s in range(4)], concurrency=2)
        assert all(o.ok for o in outcomes), [o.error for o in outcomes]
        assert {o.result["replica"] for o in outcomes} == want
        for o in outcomes:
            assert o.result["video_uri"].startswith("redis-key:")
            assert fetch_video(o.result["video_uri"], url)[4:8] == b"ftyp"


def test_metrics_give_the_next_requests_age_under_its_name_and_the_old_one(redis_db):
    """replicadp_queue_next_age_seconds is the age of the request a replica takes next, not of the oldest: with a
    batch request sent 1000 s ago and an interactive one sent 10 s ago (their send stamps), it is the interactive
    one's; the deprecated replicadp_queue_oldest_age_seconds, named for what it never measured, gives the same
    value."""
    url = declared(redis_db(), "tiny")
    proc, port = start_exporter(url)
    try:
        now = time.time()
        for seed, (priority, age) in enumerate((("batch", 1000), ("interactive", 10))):
            _app_for(url).send_task("replicadp.generate", kwargs={**TINY, "seed": seed, "priority": priority},
                                    headers={"replicadp_sent_at": now - age})
        m = scrape(port)
        tiny = (("model", "tiny"),)
        assert 10 <= m[("replicadp_queue_next_age_seconds", tiny)] <= 10 + (time.time() - now)
        assert m[("replicadp_queue_oldest_age_seconds", tiny)] == m[("replicadp_queue_next_age_seconds", tiny)]
    finally:
        stop(proc)


# --- who serves: the replicas' heartbeats (replicadp_tasks/cluster/heartbeat.py) -----------------------------------

def replicadp_status(url: str) -> str:
    run = subprocess.run([REPLICADP, "status"], env={**os.environ, "REDIS_URL": url}, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_a_killed_replica_drops_out_of_the_live_replicas_within_the_bound(redis_db, tmp_path):
    """SIGKILL of a replica's main process (its supervisor held, so that nothing restarts it under the same name):
    nothing takes it out of the heartbeats, yet live_replicas and `status` stop listing it within
    REPLICADP_REPLICA_STALE of the kill; its last beat is still in Redis, so it is the readers' bound that
    dropped it."""
    from helpers import parent_of
    from replicadp_tasks.contract.keys import SERVING_KEY

    url = redis_db()
    group = start_replicas(1, url, "killed-heartbeat", model=SYNTHETIC, OUTPUT_DIR=str(tmp_path))
    name, client = group.names[0], redis.Redis.from_url(url)
    try:
        assert live_replicas(url=url) == [name]
        main = parent_of(json.loads(client.get(REPLICA_KEY + name))["pid"])
        supervisor = parent_of(main)  # worker_launch.sh's loop for this replica, a subshell
        os.kill(supervisor, signal.SIGSTOP)
        try:
            os.kill(main, signal.SIGKILL)
            killed = time.monotonic()
            wait_for(lambda: name not in live_replicas(url=url), f"{name} to drop out of the live replicas",
                     timeout=SETTINGS.replica_stale_s + 30, interval=0.05)
            gone_s = time.monotonic() - killed
            beat = client.zscore(SERVING_KEY, name)
            status = replicadp_status(url)
        finally:
            os.kill(supervisor, signal.SIGCONT)
    finally:
        group.stop()
    print(f"\n{name} dropped out {gone_s:.2f} s after its SIGKILL (bound {SETTINGS.replica_stale_s} s)")
    assert beat is not None
    assert gone_s <= SETTINGS.replica_stale_s + 1.0
    assert name not in status and "no live replica" in status, status


def test_a_replica_reloading_its_model_is_not_live_until_it_consumes_again(redis_db, tmp_path):
    """A replica's pool child SIGKILLed mid-request: while the replacement child loads the model (held with
    SIGSTOP here, so that the reload lasts as long as the test needs), the replica is live but not serving
    (`status` says "no") and live_replicas leaves it out; resumed, it is listed again only once its main process
    consumes its model's queue (Celery's own answer to a broadcast says so), with the new child's model, and the
    requeued request completes on it. The tiny model: the new child's load (it imports torch) outlasts the
    moment the test takes to stop it."""
    from contextlib import suppress

    from helpers import parent_of, tiny_request_lasting, wait_for_step
    from replicadp_tasks.cluster.heartbeat import read

    url = redis_db()
    group = start_replicas(1, url, "reload-heartbeat", OUTPUT_DIR=str(tmp_path))
    name, client, app = group.names[0], redis.Redis.from_url(url), _app_for(url)
    replacement = None
    try:
        request = {"prompt": "through a reload", **tiny_request_lasting(3, lambda r: run_client_on(url, [r], 1)[0].result)}
        result = app.send_task("replicadp.generate", kwargs=request)
        killed = wait_for_step(SimpleNamespace(app=app), result.id, 1)["pid"]
        main = parent_of(killed)
        os.kill(killed, signal.SIGKILL)

        def new_child():
            for proc in Path("/proc").glob("[0-9]*"):
                try:
                    if int(proc.name) != killed and parent_of(int(proc.name)) == main:
                        return int(proc.name)
                except (OSError, IndexError):  # gone meanwhile
                    pass
            return None

        replacement = wait_for(new_child, "a replacement pool child", interval=0.005)
        os.kill(replacement, signal.SIGSTOP)
        assert json.loads(client.get(REPLICA_KEY + name))["pid"] == killed, "the new child loaded before it was stopped"
        wait_for(lambda: name not in live_replicas(url=url), f"{name} to stop serving", timeout=30, interval=0.05)
        assert name in read(client, SETTINGS.replica_stale_s).standby
        row = next(line for line in replicadp_status(url).splitlines() if name in line)
        assert "│ no " in row, row
        os.kill(replacement, signal.SIGCONT)
        wait_for(lambda: name in live_replicas(url=url), f"{name} to serve again", timeout=120, interval=0.05)
        queues = app.control.inspect(destination=[name], timeout=10).active_queues() or {}
        assert model_queue() in [q["name"] for q in queues.get(name, [])], queues
        assert json.loads(client.get(REPLICA_KEY + name))["pid"] == replacement
        assert result.get(timeout=120)["replica"] == name
    finally:
        if replacement is not None:
            with suppress(ProcessLookupError):
                os.kill(replacement, signal.SIGCONT)
        group.stop()
