"""The fetch policy for URLs a request carries (replicadp_tasks/inputs/fetch.py): what a request's `image` can make a
replica reach, how long it can hold it, and what the error tells the caller. Real servers on 127.0.0.x, started
by the fixtures here; a test reaches its own server only with allow_nets set to it, and proves refusal without."""

import ipaddress
import io
import socket
import threading
import time
import traceback

import pytest
import redis
from PIL import Image

from client.api import _app_for
from conftest import start_replicas
from helpers import wait_for
from replicadp_tasks.contract import FetchError, ImageInputError, RequestCancelled
from replicadp_tasks.inputs.fetch import FAILED, MAX_REDIRECTS, fetch
from replicadp_tasks.inputs import load_first_frame
from replicadp_tasks.settings import Settings
from replicadp_tasks.contract.keys import CANCEL_KEY

LOOPBACK = (ipaddress.ip_network("127.0.0.0/8"),)
SECRET = "SECRET_BANNER_TOKEN=xyz"
TRICKLE_S = 0.5  # the trickling server's pause between bytes


def png_bytes() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (40, 30), (200, 10, 10)).save(buf, format="PNG")
    return buf.getvalue()


class Server:
    """A TCP server on `host`: `respond(conn, request)` answers each connection in a thread of its own, with
    `request` the bytes it sent up to the end of its headers ("" for a banner server, which speaks first).
    Counts its connections and keeps the requests; `closed` is set once a connection has ended."""

    def __init__(self, respond, host="127.0.0.1", read_request=True):
        self.respond, self.read_request = respond, read_request
        self.sock = socket.create_server((host, 0))
        self.host, self.port = host, self.sock.getsockname()[1]
        self.requests: list[bytes] = []
        self.connected, self.closed = threading.Event(), threading.Event()
        self.closed_at = None
        self.stopping = False
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, path="/x.png") -> str:
        return f"http://{self.host}:{self.port}{path}"

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # stopped
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        self.connected.set()
        request = b""
        try:
            conn.settimeout(30)
            while self.read_request and b"\r\n\r\n" not in request:
                data = conn.recv(4096)
                if not data:
                    break
                request += data
            self.requests.append(request)
            self.respond(self, conn)
        except OSError:
            pass  # the client went away: what the deadline and cancel tests wait for
        finally:
            conn.close()
            self.closed_at = time.monotonic()
            self.closed.set()

    def stop(self):
        self.stopping = True
        self.sock.close()


@pytest.fixture
def serve():
    """Starts Servers (`serve(respond, host=...)`) and stops them after the test."""
    servers = []

    def start(respond, **kwargs) -> Server:
        servers.append(Server(respond, **kwargs))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


def answer(body: bytes, status="200 OK", headers=()):
    """A respond function: one HTTP response with `body`."""
    def respond(server, conn):
        head = [f"HTTP/1.1 {status}", f"Content-Length: {len(body)}", *headers, "Connection: close", "", ""]
        conn.sendall("\r\n".join(head).encode() + body)
    return respond


def redirect(location: str):
    return answer(b"", "302 Found", [f"Location: {location}"])


def trickle(server, conn):
    """Headers, then one byte every TRICKLE_S of a body that would take minutes."""
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
    while not server.stopping:
        conn.sendall(b"\x89")
        time.sleep(TRICKLE_S)


def banner(server, conn):
    conn.sendall(f"220 SSH-2.0 {SECRET}\r\n".encode())


def refused_text(url, **kwargs) -> tuple[str, str]:
    """(message, full formatted traceback) of the FetchError that fetching `url` raises."""
    with pytest.raises(FetchError) as caught:
        fetch(url, max_bytes=10_000, deadline_s=5, **kwargs)
    return str(caught.value), "".join(traceback.format_exception(caught.value))


# --- addresses ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("template, reason", [
    ("http://127.0.0.1:{port}/x.png", "address 127.0.0.1 of host '127.0.0.1' is loopback"),
    ("http://localhost:{port}/x.png", "an address of host 'localhost' is not public"),  # not which one
    ("http://2130706433:{port}/x.png", "address 127.0.0.1 of host '2130706433' is loopback"),
    ("http://[::1]:{port}/x.png", "address ::1 of host '::1' is loopback"),
    ("http://0.0.0.0:{port}/x.png", "address 0.0.0.0 of host '0.0.0.0' is unspecified"),
    ("http://[::ffff:127.0.0.1]:{port}/x.png", "address ::ffff:127.0.0.1 of host '::ffff:127.0.0.1' is loopback"),
    ("https://127.0.0.1:{port}/x.png", "is loopback"),
    ("http://10.1.2.3:{port}/", "is private"),
    ("http://169.254.169.254:{port}/latest/meta-data/", "is link-local"),
    ("http://100.64.0.1:{port}/", "is shared address space"),
    ("http://224.0.0.1:{port}/", "is multicast"),
    ("http://240.0.0.1:{port}/", "is reserved"),
])
def test_internal_addresses_refused_before_any_connection(serve, template, reason):
    """Every spelling of this host (IP, name, decimal, IPv6, unspecified, IPv4-mapped) and the private,
    link-local (cloud metadata), shared, multicast and reserved ranges are refused by policy, naming the
    address, the range and REPLICADP_FETCH_ALLOW; the image server listening there never sees a connection."""
    server = serve(answer(png_bytes()))
    message, _ = refused_text(template.format(port=server.port))
    assert reason in message and message.endswith("not allowed (REPLICADP_FETCH_ALLOW)"), message
    assert message.startswith(f"image='{template.format(port=server.port)[:80]}'")
    time.sleep(0.1)
    assert not server.connected.is_set()


def test_allowed_network_is_reached_with_the_right_host_header(serve):
    """With 127.0.0.0/8 allowed, the same server serves the frame, by IP and by name; the request carries the
    URL's host and port in Host, and load_first_frame decodes what came back."""
    body = png_bytes()
    server = serve(answer(body))
    assert fetch(server.url(), max_bytes=10_000, deadline_s=5, allow_nets=LOOPBACK) == body
    assert f"\r\nHost: 127.0.0.1:{server.port}\r\n".encode() in server.requests[-1]
    assert server.requests[-1].startswith(b"GET /x.png HTTP/1.1\r\n")
    img, digest = load_first_frame(server.url().replace("127.0.0.1", "localhost"), 64, 64, max_bytes=10_000,
                                   timeout_s=5, image_dir=None, allow_nets=LOOPBACK)
    assert img.size == (64, 64) and len(digest) == 64
    assert f"\r\nHost: localhost:{server.port}\r\n".encode() in server.requests[-1]


def test_allow_list_is_exact(serve):
    """Allowing one address (127.0.0.2/32) reaches a server there and nothing else on loopback."""
    other = serve(answer(png_bytes()), host="127.0.0.2")
    assert fetch(other.url(), max_bytes=10_000, deadline_s=5, allow_nets=[ipaddress.ip_network("127.0.0.2/32")])
    message, _ = refused_text(other.url().replace("127.0.0.2", "127.0.0.1"),
                              allow_nets=[ipaddress.ip_network("127.0.0.2/32")])
    assert "is loopback, not allowed" in message


# --- redirects ------------------------------------------------------------------------------------------

def test_redirect_to_an_address_not_allowed_is_refused(serve):
    """An allowed server (127.0.0.2, the only network allowed) that redirects to 127.0.0.1 gets its redirect
    refused by the same policy, checked again for the new host: the server behind it never sees a connection.
    The error names the redirect by number, never its Location."""
    inner = serve(answer(f"inner {SECRET}".encode()))
    outer = serve(redirect(inner.url("/private?" + SECRET)), host="127.0.0.2")
    message, _ = refused_text(outer.url(), allow_nets=[ipaddress.ip_network("127.0.0.2/32")])
    assert "redirect 1: address 127.0.0.1 of its host is loopback, not allowed (REPLICADP_FETCH_ALLOW)" in message
    assert SECRET not in message
    assert outer.connected.is_set() and not inner.connected.is_set()


def test_redirects_are_followed_within_the_policy_and_bounded(serve):
    """Where both hops are allowed, a redirect (relative or absolute) is followed to the body; a chain longer
    than MAX_REDIRECTS is refused."""
    body = png_bytes()
    target = serve(answer(body))
    relay = serve(redirect(target.url()))
    assert fetch(relay.url(), max_bytes=10_000, deadline_s=5, allow_nets=LOOPBACK) == body
    hops = {"n": 0}

    def loop(server, conn):
        hops["n"] += 1
        redirect(f"/again{hops['n']}")(server, conn)

    looping = serve(loop)
    message, _ = refused_text(looping.url(), allow_nets=LOOPBACK)
    assert f"more than {MAX_REDIRECTS} redirects" in message and hops["n"] == MAX_REDIRECTS + 1


@pytest.mark.parametrize("location", ["ftp://127.0.0.1/x.png", "file:///etc/passwd", "gopher://127.0.0.1:6379/_INFO"])
def test_redirect_to_another_scheme_is_refused(serve, location):
    """A redirect to ftp://, file:// or gopher:// is refused: http and https only, on every hop."""
    server = serve(redirect(location))
    message, _ = refused_text(server.url(), allow_nets=LOOPBACK)
    assert "redirect 1: scheme not allowed; only http and https" in message
    assert location.split(":")[0] not in message.split(": ", 1)[1]


# --- what the error tells ---------------------------------------------------------------------------------

def test_remote_answers_never_reach_the_error(serve):
    """A TCP service that is not HTTP (an SSH-style banner with a secret), a closed port and a connection reset
    all fail with the same generic message, which holds nothing the remote side sent: not in the message, not in
    the formatted traceback (which Celery stores with the result). An HTTP error's reason phrase and body stay
    out too: only its status code is named."""
    allow = {"allow_nets": LOOPBACK}
    banner_server = serve(banner, read_request=False)
    closed = socket.create_server(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()

    def reset(server, conn):
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")

    reset_server = serve(reset)
    garbage = serve(lambda server, conn: conn.sendall(f"HTTP/1.1 2x0 {SECRET}\r\n\r\n".encode()))
    texts = {}
    for name, port in (("banner", banner_server.port), ("closed", closed_port), ("reset", reset_server.port),
                       ("garbage", garbage.port)):
        message, formatted = refused_text(f"http://127.0.0.1:{port}/x.png", **allow)
        assert SECRET not in formatted and "SSH" not in formatted, formatted
        texts[name] = message.replace(str(port), "PORT")
    assert set(texts.values()) == {f"image='http://127.0.0.1:PORT/x.png': {FAILED}"}, texts
    not_found = serve(answer(f"body {SECRET}".encode(), status=f"404 {SECRET}"))
    message, formatted = refused_text(not_found.url(), **allow)
    assert message.endswith(": HTTP status 404") and SECRET not in formatted
    with pytest.raises(ImageInputError) as caught:
        load_first_frame(f"http://127.0.0.1:{banner_server.port}/x.png", 64, 64, max_bytes=10_000, timeout_s=5,
                         image_dir=None, allow_nets=LOOPBACK)
    assert FAILED in str(caught.value)
    assert SECRET not in "".join(traceback.format_exception(caught.value))


def test_oversized_body_is_refused(serve):
    """A body over max_bytes is refused, whether its Content-Length says so up front or it just keeps coming
    (a close-delimited stream): the download stops past max_bytes."""
    big = serve(answer(b"\0" * 50_000))
    message, _ = refused_text(big.url(), allow_nets=LOOPBACK)
    assert message.endswith("more than 10000 bytes (REPLICADP_MAX_IMAGE_BYTES)")

    def endless(server, conn):
        conn.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n")
        while not server.stopping:
            conn.sendall(b"\0" * 65536)

    stream = serve(endless)
    message, _ = refused_text(stream.url(), allow_nets=LOOPBACK)
    assert message.endswith("more than 10000 bytes (REPLICADP_MAX_IMAGE_BYTES)")
    assert stream.closed.wait(5)


# --- time -----------------------------------------------------------------------------------------------

def test_trickling_server_is_stopped_at_the_total_deadline(serve):
    """A server that sends a byte every 0.5 s (each read well inside any per-read timeout) is cut off at the
    total deadline, and its connection is closed, not left to trickle on."""
    deadline_s = 2
    server = serve(trickle)
    start = time.monotonic()
    with pytest.raises(FetchError, match=r"took longer than 2 s \(REPLICADP_IMAGE_TIMEOUT\)"):
        fetch(server.url(), max_bytes=1_000_000, deadline_s=deadline_s, allow_nets=LOOPBACK)
    elapsed = time.monotonic() - start
    assert deadline_s <= elapsed < deadline_s + 2, elapsed
    assert server.closed.wait(2 + 2 * TRICKLE_S)


def test_silent_server_is_stopped_at_the_total_deadline(serve):
    """A server that accepts and never answers fails at the deadline too, through load_first_frame."""
    server = serve(lambda server, conn: time.sleep(30))
    start = time.monotonic()
    with pytest.raises(ImageInputError, match=r"took longer than 1 s"):
        load_first_frame(server.url(), 64, 64, max_bytes=10_000, timeout_s=1, image_dir=None, allow_nets=LOOPBACK)
    assert time.monotonic() - start < 1 + 2


def test_cancel_stops_a_trickling_download(serve):
    """cancelled() turning True mid-download raises RequestCancelled within a second, long before the deadline,
    and the connection is closed."""
    server = serve(trickle)
    cancel, flipped = threading.Event(), {}

    def cancel_later():
        wait_for(lambda: server.requests, "the download to start", timeout=10, interval=0.05)
        time.sleep(1)  # a couple of trickled bytes in
        flipped["at"] = time.monotonic()
        cancel.set()

    threading.Thread(target=cancel_later, daemon=True).start()
    with pytest.raises(RequestCancelled, match="cancelled during the download"):
        fetch(server.url(), max_bytes=1_000_000, deadline_s=60, allow_nets=LOOPBACK, cancelled=cancel.is_set)
    assert time.monotonic() - flipped["at"] < 1
    assert server.closed.wait(2 + 2 * TRICKLE_S)


# --- the setting ----------------------------------------------------------------------------------------

def test_fetch_allow_setting(monkeypatch):
    """REPLICADP_FETCH_ALLOW: empty allows nothing, a list of CIDRs is parsed once, a bad value stops start-up
    with a message that names the variable and the value."""
    monkeypatch.delenv("REPLICADP_FETCH_ALLOW", raising=False)
    assert Settings.from_env().fetch_allow == ()
    monkeypatch.setenv("REPLICADP_FETCH_ALLOW", "10.0.0.0/8, fd00::/8,")
    assert Settings.from_env().fetch_allow == (ipaddress.ip_network("10.0.0.0/8"), ipaddress.ip_network("fd00::/8"))
    for bad in ("10.0.0.1/8", "intranet", "10.0.0.0/33"):
        monkeypatch.setenv("REPLICADP_FETCH_ALLOW", bad)
        with pytest.raises(SystemExit, match=f"REPLICADP_FETCH_ALLOW: '{bad}' is not a network"):
            Settings.from_env()


# --- with a real replica ----------------------------------------------------------------------------------

def test_cancel_reaches_a_replica_stuck_on_a_trickling_image(serve, redis_db, tiny_model, tmp_path):
    """A replica (127.0.0.0/8 allowed, a 60 s image deadline) downloading a first frame from a server that
    trickles is freed by cancel_request at once: the request fails with RequestCancelled within seconds of the
    cancel, not at the deadline, and the replica then serves a request with an image from a working server."""
    url = redis_db()
    group = start_replicas(1, url, "fetch", OUTPUT_DIR=str(tmp_path), REPLICADP_FETCH_ALLOW="127.0.0.0/8",
                           REPLICADP_IMAGE_TIMEOUT="60")
    try:
        app = _app_for(url)
        slow = serve(trickle)
        request = {"prompt": "a slow frame", "height": 64, "width": 64, "num_frames": 5, "num_inference_steps": 2}
        result = app.send_task("replicadp.generate", kwargs={**request, "image": slow.url()})
        wait_for(lambda: slow.requests, "the replica to request the image", timeout=60, interval=0.05)
        cancelled_at = time.monotonic()
        # What client.api.cancel_request does, on this test's database (the process's app is on DB 0).
        redis.Redis.from_url(url).set(CANCEL_KEY + result.id, 1, ex=600)
        with pytest.raises(RequestCancelled, match="cancelled during the download"):
            result.get(timeout=30)
        assert time.monotonic() - cancelled_at < 5
        assert slow.closed.wait(5)
        good = serve(answer(png_bytes()))
        done = app.send_task("replicadp.generate", kwargs={**request, "image": good.url()}).get(timeout=60)
        assert done["replica"] == group.names[0]
    finally:
        group.stop()
