"""The gateway under abuse and through Redis outages: real `replicadp serve-http` processes (test_http's `gateway`)
on 127.0.0.1, spoken to with httpx, in front of an embedded Redis of the test's own that it restarts."""

import base64
import os
import signal
import socket
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis
from conftest import start_replicas
from helpers import SYNTHETIC, wait_for
from test_http import LONG, SMALL, gateway, multipart

from client.local.embedded import EmbeddedServer
from replicadp_tasks.contract import ImageInputError
from replicadp_tasks.inputs import load_first_frame

BURST = 80  # more requests at once than the gateway's pool holds connections (REDIS_CONNECTIONS)


def burst(gw) -> list[int]:
    """The status of BURST concurrent GET /v1/videos (each reads Redis), each on a connection of its own."""
    def one(_):
        return httpx.get(f"{gw.url}/v1/videos", timeout=60).status_code
    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(one, range(BURST)))


def answers_ping(url: str) -> bool:
    try:
        return redis.Redis.from_url(url, socket_timeout=1).ping()
    except redis.ConnectionError:
        return False


@pytest.mark.cluster  # restarts a Redis of its own twice: too long for the quick loop
def test_the_gateway_rides_out_a_redis_restart_and_a_down_up(tmp_path):
    """A gateway whose pooled Redis connections all died (Redis killed and started again on its port, then
    stopped and started again later, as `replicadp down`/`up` do) answers every request of a burst once Redis
    answers PING: a dead pooled connection is replaced, not handed to a request (on the old pool, without
    retries, some of the burst got 503 "cannot reach Redis")."""
    folder = tmp_path / "redis"
    server = EmbeddedServer(folder)
    url = server.start()
    try:
        with gateway(url, "redis-restart") as gw:
            assert burst(gw) == [200] * BURST  # fills the pool with connections, all idle after
            os.kill(server.proc.pid, signal.SIGKILL)  # a crash: every pooled connection dies with it
            server.proc.wait()
            server = EmbeddedServer(folder, port=server.port, password=server.password)
            server.start()
            wait_for(lambda: answers_ping(url), "Redis to answer again")
            assert burst(gw) == [200] * BURST
            server.stop()  # `replicadp down`: a clean stop
            assert not answers_ping(url)
            assert gw.client.get("/v1/videos").status_code == 503  # while it is down: a clean 503
            server = EmbeddedServer(folder, port=server.port, password=server.password)
            server.start()  # `replicadp up`
            wait_for(lambda: answers_ping(url), "Redis to answer again")
            assert burst(gw) == [200] * BURST
    finally:
        server.stop()


@pytest.fixture(scope="module")
def keyless(redis_db):
    """A gateway without API keys on a DB with no replica, bound to loopback (the default allow-list), that
    refuses every request past validation (max queue 0): a POST that gets through is answered 429."""
    with gateway(redis_db(), "abuse-keyless", "--max-queue", "0") as gw:
        yield gw


def test_a_foreign_host_gets_400_but_health_answers_any(keyless, redis_db):
    """Bound to loopback, the gateway answers Host names of loopback at any port and refuses any other (a
    DNS-rebound name reading /v1/videos) with 400 in OpenAI's error shape; /health answers whatever the Host (a
    load balancer's probe); --allowed-hosts replaces the default."""
    c = keyless.client
    for name in ("localhost:1234", "127.0.0.1", "[::1]:8098", "LocalHost"):
        assert c.get("/v1/videos", headers={"Host": name}).status_code == 200, name
    refused = c.get("/v1/videos", headers={"Host": "rebound.example:8098"})
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "invalid_host"
    assert "rebound.example" in refused.json()["error"]["message"]
    assert c.get("/health", headers={"Host": "10.0.0.5:8098"}).status_code == 503  # no replica: not a 400
    # 127.0.0.1 too: the `gateway` helper asks for /openapi.json by it
    with gateway(redis_db(), "abuse-hosts", "--allowed-hosts", "api.example", "--allowed-hosts", "127.0.0.1") as gw:
        assert gw.client.get("/v1/videos", headers={"Host": "api.example:443"}).status_code == 200
        assert gw.client.get("/v1/videos", headers={"Host": "localhost"}).status_code == 400


def test_a_cross_site_post_or_delete_is_refused_without_keys(keyless, redis_db):
    """Without API keys, a POST or DELETE whose Origin is another site (a cross-site form) gets 403 and creates
    no job; one from the gateway's own origin, or with no Origin (curl, SDKs), goes on (here to the 429 of a
    full queue). With API keys the key decides, not the Origin."""
    c, form = keyless.client, multipart(SMALL)
    for origin in ("http://evil.example", "null", "http://127.0.0.1.evil.example"):
        refused = c.post("/v1/videos", files=form, headers={"Origin": origin})
        assert refused.status_code == 403, origin
        assert refused.json()["error"]["code"] == "foreign_origin"
    assert c.delete("/v1/videos/x", headers={"Origin": "http://evil.example"}).status_code == 403
    assert c.get("/v1/videos").json()["data"] == []
    assert c.post("/v1/videos", files=form, headers={"Origin": keyless.url}).status_code == 429
    assert c.post("/v1/videos", files=form).status_code == 429
    with gateway(redis_db(), "abuse-keyed", "--max-queue", "0", "--api-key", "sk-abuse-1") as gw:
        keyed = gw.client.post("/v1/videos", files=form, headers={"Origin": "http://evil.example",
                                                                   "Authorization": "Bearer sk-abuse-1"})
        assert keyed.status_code == 429


def test_every_answer_says_nosniff_and_no_referrer_and_redirects_by_path(keyless):
    """Every answer (a list, an error of the guard's, of a route's, of Starlette's, the web page) carries
    X-Content-Type-Options: nosniff and Referrer-Policy: no-referrer; /docs (a CDN's scripts, same-origin with
    /ui) is off by default; /ui/ redirects to the path /ui, not to a URL built from the Host header, and no
    other path gets a Host-built slash redirect."""
    c = keyless.client
    answers = [c.get("/v1/videos"), c.get("/v1/videos/nope"), c.get("/ui"), c.put("/v1/videos"),
               c.get("/v1/videos", headers={"Host": "evil.example"}), c.get("/health")]
    for answer in answers:
        assert answer.headers["x-content-type-options"] == "nosniff", answer.url
        assert answer.headers["referrer-policy"] == "no-referrer", answer.url
    assert c.get("/docs").status_code == 404
    assert c.get("/redoc").status_code == 404
    slash = c.get("/ui/", headers={"Host": "localhost:9"})
    assert slash.status_code == 307 and slash.headers["location"] == "/ui"
    assert c.get("/v1/videos/", headers={"Host": "localhost:9"}).status_code == 404


@pytest.mark.parametrize("loras, why", [
    ("[" * 1000 + "]" * 1000, "nests lists or objects deeper than 8"),  # had been a 500, its connection reset
    ("[" * 9 + "]" * 9, "nests lists or objects deeper than 8"),
    ('[{"name": "style", "scale": 1' + "0" * 5000 + "}]", "characters long; the limit is 4096"),
    ('[{"name": "style", "scale": 1' + "0" * 40 + "}]", "a number of 41 characters"),
    ('[{"name": "style", "scale": 1e999}]', "1e999 is not a finite number"),
    ('[{"name": "style", "scale": NaN}]', "NaN is not a number JSON allows"),
    ('[{"name": "style", "name": "other"}]', "key 'name' given twice"),
    ('[{"name": "' + "x" * 5000 + '"}]', "characters long; the limit is 4096"),
])
def test_json_that_would_exhaust_the_decoder_is_a_400_naming_the_field(keyless, loras, why):
    """A form field that carries JSON (`loras`) is bounded before and while it is decoded: nested too deep (a
    RecursionError in the decoder had answered 500, plain text, without the security headers, and reset the
    connection), too long, a number too long or not finite, a key given twice. Each is a 400 naming `loras`, with
    the headers every answer carries, and the next request on the same connection is answered."""
    c = keyless.client
    refused = c.post("/v1/videos", files=multipart({**SMALL, "loras": loras}))
    assert refused.status_code == 400, refused.text[:300]
    error = refused.json()["error"]
    assert error["param"] == "loras" and why in error["message"], error
    assert refused.headers["x-content-type-options"] == "nosniff"
    assert c.get("/v1/videos").status_code == 200  # the same keep-alive connection


def test_idle_and_slow_connections_are_closed_and_health_answers_at_the_limit(redis_db):
    """Connections that send nothing, or headers never finished, past --max-connections: /health (a new
    connection) still gets an answer (uvicorn's 503 at the limit, not a hang or a refused accept), and each idle
    or slow connection is closed by the server once --header-timeout passes (on the old gateway they stayed open
    for good), after which /health answers the app's own body again."""
    limit = 8
    with gateway(redis_db(), "abuse-limit", "--max-connections", str(limit), "--header-timeout", "2") as gw:
        host, port = gw.url.removeprefix("http://").split(":")
        idle = [socket.create_connection((host, int(port))) for _ in range(limit + 4)]
        idle[0].sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # headers never finished
        try:
            assert httpx.get(f"{gw.url}/health", timeout=30).status_code == 503  # the limit's, or no replica
            for conn in idle:
                conn.settimeout(60)
                assert conn.recv(1024) == b""  # closed by the server, unanswered
        finally:
            for conn in idle:
                conn.close()
        health = wait_for(lambda: httpx.get(f"{gw.url}/health", timeout=30), "an answer")
        assert health.json()["status"] == "unavailable"  # the app's answer (no replica), not the limit's


def test_idle_sockets_past_the_file_limit_are_shed_and_health_answers_throughout(redis_db):
    """A gateway whose open-file limit is 256 (its default connection limit then 128), against 300 connections
    that send nothing and are opened again whenever the gateway closes one: those silent longest are closed as new
    ones come and every tenth of a second, so /health, asked 12 times half a second apart on a new connection, is
    answered every time within 5 s (by the app, or by uvicorn's 503 at the limit; the app's at least once), and a
    failing accept() is logged at most once per 10 s (had been: /health timed out and the log took a traceback
    per accept, 294,420 in two minutes)."""
    import resource
    import threading
    import time

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))  # the gateway inherits it
    try:
        gw_context = gateway(redis_db(), "abuse-fds", "--header-timeout", "60")
        gw = gw_context.__enter__()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        host, port = gw.url.removeprefix("http://").split(":")
        stop, opened = threading.Event(), [0]

        def hold():  # 300 idle connections, each opened again once the gateway closes it
            conns = []
            while not stop.is_set():
                conns = [c for c in conns if c.fileno() != -1]
                while len(conns) < 300 and not stop.is_set():
                    try:
                        conns.append(socket.create_connection((host, int(port)), timeout=2))
                        opened[0] += 1
                    except OSError:
                        break
                for c in list(conns):
                    try:
                        c.setblocking(False)
                        if c.recv(1) == b"":  # closed by the gateway
                            c.close()
                    except BlockingIOError:
                        pass
                    except OSError:
                        c.close()
                time.sleep(0.05)
            for c in conns:
                c.close()

        attacker = threading.Thread(target=hold, daemon=True)
        attacker.start()
        statuses = []
        for _ in range(12):
            answer = httpx.get(f"{gw.url}/health", timeout=5)  # no timeout, no reset
            app = answer.headers.get("content-type") == "application/json"
            statuses.append((answer.status_code, answer.json()["status"] if app else answer.text))
            time.sleep(0.5)
        stop.set()
        attacker.join(timeout=30)
    finally:
        gw_context.__exit__(None, None, None)
    # The app's answer (no replica here), or uvicorn's at the connection limit while the silent connections are too
    # young to close; the app's at least once.
    assert set(statuses) <= {(503, "unavailable"), (503, "Service Unavailable")} and (503, "unavailable") in statuses
    assert opened[0] > 300  # the gateway closed idle connections as new ones came
    log = gw.log_path.read_text()
    assert "socket.accept() out of system resource" not in log, log[-3000:]  # asyncio's own line, a traceback each
    assert log.count("cannot accept connections") <= 2, log[-3000:]


def test_image_errors_name_what_was_sent_not_what_the_server_resolved(tmp_path):
    """A first frame that does not decode is refused without PIL's message (the repr of the replica's buffer,
    `<_io.BytesIO object at 0x...>`); a URL whose name resolves to an internal address is refused without the
    address (a DNS oracle of the replica's network); a missing local file without its resolved path."""
    def refusal(image: str, **kw) -> str:
        with pytest.raises(ImageInputError) as caught:
            load_first_frame(image, 64, 64, max_bytes=10_000, timeout_s=5, image_dir=kw.get("image_dir"))
        return str(caught.value)

    garbage = refusal(base64.b64encode(b"not an image at all").decode())
    assert "cannot decode" in garbage and "BytesIO" not in garbage and "0x" not in garbage
    named = refusal("http://localhost:9/x.png")
    assert "localhost" in named and "127.0.0.1" not in named and "::1" not in named and "loopback" not in named
    missing = refusal("nope.png", image_dir=tmp_path)
    assert "nope.png" in missing and str(tmp_path) not in missing


@pytest.mark.cluster
def test_a_keyless_gateway_sees_no_keyed_job_and_status_names_only_ones_own(redis_db):
    """A keyless gateway and a keyed one on the same Redis, in front of one replica: the keyless one neither
    lists, serves nor deletes the keyed gateway's running job (on the old gateway, the set of keyless jobs was
    the set of every job, and a keyless GET found any record), and its /v1/status shows that replica busy
    without the job's id, prompt, phase or progress, which the job's own key sees."""
    url = redis_db()
    group = start_replicas(1, url, "abuse-tenants", model=SYNTHETIC)
    auth = {"Authorization": "Bearer sk-abuse-tenant"}
    try:
        with gateway(url, "abuse-open") as open_gw, \
                gateway(url, "abuse-closed", "--api-key", "sk-abuse-tenant") as keyed:
            job = keyed.client.post("/v1/videos", files=multipart(LONG), headers=auth).json()["id"]

            def running(gw, **kw):
                replicas = gw.client.get("/v1/status", **kw).json()["replicas"]
                return next((r["running"] for r in replicas if r["running"]), None)

            assert wait_for(lambda: running(keyed, headers=auth), "the job to run")["id"] == job
            assert running(open_gw) == {"id": None, "step": None, "total_steps": None, "prompt": None, "phase": None}
            assert open_gw.client.get("/v1/videos").json()["data"] == []
            assert open_gw.client.get(f"/v1/videos/{job}").status_code == 404
            assert open_gw.client.delete(f"/v1/videos/{job}").status_code == 404
            assert keyed.client.get(f"/v1/videos/{job}", headers=auth).status_code == 200
            keyed.client.delete(f"/v1/videos/{job}", headers=auth)
    finally:
        group.stop()


def test_a_fault_in_the_gateway_and_a_redis_failure_answer_json_with_the_headers_and_no_address():
    """The two answers no input should reach, from the gateway's own app in this process (two routes added that
    raise): a fault is a 500 in OpenAI's error object with the security headers (Starlette's own was plain text
    without them) and no traceback; a Redis failure is a 503 that names the kind of failure, not the server's
    address (redis-py's message has it: the deployment's business, not the caller's)."""
    from fastapi.testclient import TestClient

    from client.http.app import create_app

    app = create_app()

    @app.get("/v1/fault")
    def fault():
        raise RuntimeError("a bug, with internals: /srv/secret")

    @app.get("/v1/redis-down")
    def redis_down():
        raise redis.ConnectionError("Error 111 connecting to 10.20.30.40:6379. Connection refused.")

    client = TestClient(app, base_url="http://127.0.0.1", raise_server_exceptions=False)  # no lifespan: no Redis
    broken = client.get("/v1/fault")
    assert broken.status_code == 500 and broken.json()["error"]["code"] == "internal_error", broken.text
    assert "/srv/secret" not in broken.text and "Traceback" not in broken.text
    assert broken.headers["x-content-type-options"] == "nosniff" and broken.headers["referrer-policy"] == "no-referrer"
    down = client.get("/v1/redis-down")
    assert down.status_code == 503 and down.json()["error"]["code"] == "redis_unavailable", down.text
    assert "10.20.30.40" not in down.text and "ConnectionError" in down.text
    assert down.headers["x-content-type-options"] == "nosniff"
