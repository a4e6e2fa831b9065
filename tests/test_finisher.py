"""The finisher (replicadp_tasks/replica/finisher.py): a replica computes its next request while its pool child's finisher
thread encodes, stores and answers the one before, and nothing is lost or answered twice for it. The finish is held
where the test wants it: the replicas store into an S3-protocol server through a gate, an HTTP proxy of the test's
that holds every PUT while it is closed (reads go through), so no outcome depends on how fast anything runs here."""

import http.client
import os
import signal
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from urllib.parse import urlsplit

import pytest
import redis
from conftest import start_replicas
from helpers import SYNTHETIC, lasting, progress, wait_for, wait_for_reload
from test_logs import json_lines

from client.api import _app_for, live_replicas
from replicadp_tasks.contract import Phase, RequestCancelled, RequestState
from replicadp_tasks.contract.keys import ATTEMPTS_KEY, CANCEL_CHANNEL, CANCEL_KEY

pytestmark = pytest.mark.cluster


class Gate(ThreadingHTTPServer):
    """An HTTP proxy on 127.0.0.1 to `upstream`: it passes every request on, but holds a PUT while `open` is clear."""

    daemon_threads = True

    def __init__(self, upstream: str):
        self.upstream, self.open = urlsplit(upstream), threading.Event()
        self.open.set()
        super().__init__(("127.0.0.1", 0), GateHandler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class GateHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def forward(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.command == "PUT":
            self.server.open.wait(120)
        upstream = http.client.HTTPConnection(self.server.upstream.hostname, self.server.upstream.port, timeout=60)
        try:
            upstream.request(self.command, self.path, body, dict(self.headers))
            answer = upstream.getresponse()
            data = answer.read()
        finally:
            upstream.close()
        self.send_response(answer.status)
        for name, value in answer.getheaders():
            if name.lower() not in ("content-length", "transfer-encoding", "connection"):
                self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = forward

    def log_message(self, *args) -> None:
        pass


@contextmanager
def gated_replica(url: str, s3_server, s3_bucket: str, name: str = "finisher", **env):
    """One synthetic replica on `url` that stores into `s3_bucket` on the session's S3 server, through a gate
    (`.gate.open`); `env`: more of its settings."""
    gate = Gate(s3_server.url)
    threading.Thread(target=gate.serve_forever, daemon=True).start()
    try:
        group = start_replicas(1, url, name, model=SYNTHETIC, REPLICADP_STORE="s3", REPLICADP_S3_BUCKET=s3_bucket,
                               REPLICADP_S3_ENDPOINT_URL=gate.url, **env)
        try:
            yield SimpleNamespace(group=group, app=_app_for(url), redis=redis.Redis.from_url(url), s3=s3_server,
                                  bucket=s3_bucket, gate=gate, url=url)
        finally:
            gate.open.set()
            group.stop()
    finally:
        gate.shutdown()
        gate.server_close()


@pytest.fixture
def one_replica(redis_db, s3_server, s3_bucket):
    """gated_replica on a database of the test's own."""
    with gated_replica(redis_db(), s3_server, s3_bucket) as r:
        yield r


@contextmanager
def closed(gate: Gate):
    """No PUT goes through the gate meanwhile: a store waits until it opens again, also on failure."""
    gate.open.clear()
    try:
        yield
    finally:
        gate.open.set()


def phase_of(r, task_id: str, what: str) -> str | None:
    info = progress(r.app, task_id, what)
    return info["phase"] if info else None


def stored_pairs(r) -> list[str]:
    """The names of the Results in the bucket (each marks a stored pair)."""
    return sorted(o["Key"].rsplit("/", 1)[-1] for o in r.s3.client.list_objects_v2(Bucket=r.bucket).get("Contents", [])
                  if o["Key"].endswith(".json"))


def test_the_next_request_is_computed_while_the_one_before_is_stored(one_replica):
    """With the store's writes held, request A waits in its finish (phase storing, no answer), and the replica computes
    request B meanwhile, to its last step; a third request, C, stays queued: the replica holds the request it
    computes and the one it finishes, no more. Once the store goes on, all three succeed, each stored once."""
    r = one_replica
    with closed(r.gate):
        a = r.app.send_task("replicadp.generate", kwargs=lasting(0.25, prompt="a", seed=1))
        wait_for(lambda: phase_of(r, a.id, "A to store") == Phase.STORING, "A to wait in its store", interval=0.02)
        b = r.app.send_task("replicadp.generate", kwargs=lasting(0.5, prompt="b", seed=2))
        c = r.app.send_task("replicadp.generate", kwargs=lasting(0.25, prompt="c", seed=3))
        wait_for(lambda: phase_of(r, b.id, "B to compute") == Phase.DECODING, "B to reach its last step",
                 interval=0.02)
        assert phase_of(r, a.id, "B's last step") == Phase.STORING
        assert r.app.backend.get_task_meta(c.id)["status"] == RequestState.PENDING
    results = [x.get(timeout=60) for x in (a, b, c)]
    assert [m["params"]["seed"] for m in results] == [1, 2, 3]
    assert stored_pairs(r) == sorted(f"{m['request_id']}.json" for m in results)


def test_a_pool_child_killed_while_it_finishes_loses_nothing(one_replica):
    """SIGKILL of the pool child while request A waits in its finish and request B has been computed: the main
    process requeues both (A: its lease thread sees the child gone; B: Celery reports the child lost); once the
    replica has reloaded and the store goes on, both succeed, each started twice, each stored once."""
    r = one_replica
    with closed(r.gate):
        a = r.app.send_task("replicadp.generate", kwargs=lasting(0.25, prompt="a", seed=4))
        wait_for(lambda: phase_of(r, a.id, "A to store") == Phase.STORING, "A to wait in its store", interval=0.02)
        b = r.app.send_task("replicadp.generate", kwargs=lasting(0.25, prompt="b", seed=5))
        info = wait_for(lambda: (progress(r.app, b.id, "B to compute") or {}).get("phase") == Phase.DECODING
                        and progress(r.app, b.id, "B's pid"), "B to reach its last step", interval=0.02)
        os.kill(info["pid"], signal.SIGKILL)
        replica = info["replica"]
    wait_for_reload(r.redis, replica, info["pid"])
    results = [x.get(timeout=60) for x in (a, b)]
    assert [m["params"]["seed"] for m in results] == [4, 5]
    assert [int(r.redis.get(ATTEMPTS_KEY + x.id)) for x in (a, b)] == [2, 2]
    assert stored_pairs(r) == sorted(f"{m['request_id']}.json" for m in results)


def test_a_warm_shutdown_answers_the_request_being_finished(one_replica):
    """A warm shutdown (SIGTERM) of the replica while request A waits in its finish: the pool child answers it
    before it exits, so it is not computed again (started once)."""
    r = one_replica
    with closed(r.gate):
        a = r.app.send_task("replicadp.generate", kwargs=lasting(0.25, prompt="a", seed=6))
        wait_for(lambda: phase_of(r, a.id, "A to store") == Phase.STORING, "A to wait in its store", interval=0.02)
        [name] = r.group.names
        stopping = threading.Thread(target=r.group.stop)
        stopping.start()
        wait_for(lambda: name not in live_replicas(url=r.url), f"{name} to stop taking requests")
    stopping.join(120)
    assert not stopping.is_alive()
    assert a.get(timeout=5)["params"]["seed"] == 6
    assert int(r.redis.get(ATTEMPTS_KEY + a.id)) == 1


def test_a_finish_waits_for_the_next_request_to_compute(redis_db, s3_server, s3_bucket):
    """A finish starts once the replica has begun computing the next request, so that the next one's hand-over
    runs alone: with REPLICADP_FINISHER_WAIT_MS long, request A, alone, stays at its last phase (not encoded, not
    answered) a second after its last step; once request B is sent and computes, A is answered. A warm shutdown
    then answers B at once, not after the wait."""
    with gated_replica(redis_db(), s3_server, s3_bucket, "finisher-wait", REPLICADP_FINISHER_WAIT_MS="600000") as r:
        a = r.app.send_task("replicadp.generate", kwargs=lasting(0.25, prompt="a", seed=10))
        wait_for(lambda: phase_of(r, a.id, "A to compute") == Phase.DECODING, "A to reach its last step",
                 interval=0.02)
        time.sleep(1.0)  # a finish that did not wait would be done: 64x64x5 frames encode in milliseconds
        assert phase_of(r, a.id, "A's finish") == Phase.DECODING
        assert r.app.backend.get_task_meta(a.id)["status"] == RequestState.PROGRESS
        b = r.app.send_task("replicadp.generate", kwargs=lasting(0.5, prompt="b", seed=11))
        assert a.get(timeout=60)["params"]["seed"] == 10
        wait_for(lambda: phase_of(r, b.id, "B to compute") == Phase.DECODING, "B to reach its last step",
                 interval=0.02)
        r.group.stop()  # a warm shutdown: SIGKILL after 60 s, which would leave B unanswered
        assert b.get(timeout=5)["params"]["seed"] == 11
        assert int(r.redis.get(ATTEMPTS_KEY + b.id)) == 1


def nice_values(pid: int) -> dict[int, int]:
    """Each thread of process `pid`: its nice value, by thread id (/proc/PID/task/TID/stat, field 19)."""
    values = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/stat") as stat:
            values[int(task)] = int(stat.read().rsplit(")", 1)[1].split()[16])
    return values


def test_the_finisher_yields_the_cpu_to_the_next_request(one_replica):
    """While request A waits in its finish, its pool child's finisher thread runs at nice 10
    (REPLICADP_FINISHER_NICE; the synthetic backend computes off the CPU, as a GPU does), the thread that computes
    requests at the process's own 0: where cores are short, the kernel runs the next request's hand-over first."""
    r = one_replica
    with closed(r.gate):
        a = r.app.send_task("replicadp.generate", kwargs=lasting(0.25, prompt="a", seed=7))
        info = wait_for(lambda: phase_of(r, a.id, "A to store") == Phase.STORING and progress(r.app, a.id, "A's pid"),
                        "A to wait in its store", interval=0.02)
        nice = nice_values(info["pid"])
    assert nice.pop(info["pid"]) == 0, "the main thread"
    assert 10 in nice.values(), nice
    assert a.get(timeout=60)["params"]["seed"] == 7


def test_the_finisher_logs_name_the_request_it_finishes(redis_db, s3_server, s3_bucket):
    """In JSON logs, the line of a request that fails in its finish (A, cancelled while its video was stored) names
    A, not B, the request its pool child computes meanwhile."""
    with gated_replica(redis_db(), s3_server, s3_bucket, "finisher-logs", REPLICADP_LOG_FORMAT="json") as r:
        with closed(r.gate):
            a = r.app.send_task("replicadp.generate", kwargs=lasting(0.25, prompt="a", seed=8))
            wait_for(lambda: phase_of(r, a.id, "A to store") == Phase.STORING, "A to wait in its store",
                     interval=0.02)
            b = r.app.send_task("replicadp.generate", kwargs=lasting(20, prompt="b", seed=9))
            wait_for(lambda: phase_of(r, b.id, "B to compute") == Phase.DENOISING, "B to compute", interval=0.02)
            r.redis.set(CANCEL_KEY + a.id, 1)
        with pytest.raises(RequestCancelled):
            a.get(timeout=60)
        r.redis.set(CANCEL_KEY + b.id, 1)
        r.redis.publish(CANCEL_CHANNEL, b.id)
        with pytest.raises(RequestCancelled):
            b.get(timeout=60)
        log_path = r.group.log_path
    failed = [line for line in json_lines(log_path) if line["message"].startswith(f"request {a.id} failed")]
    assert failed and all(line.get("task_id") == a.id and line.get("request_id") == a.id for line in failed), failed
