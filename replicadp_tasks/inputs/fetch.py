"""Fetching a URL that a request carries (the `image` first frame): http(s) only, to public addresses unless
the operator allows a network, within one total deadline and a byte bound, cancellable, and with errors that
never repeat what the remote side answered (no service behind an allowed address can be read or told apart
through them)."""

from __future__ import annotations

import http.client
import ipaddress
import logging
import socket
import ssl
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Callable, Sequence

from ..contract.errors import FetchError, RequestCancelled

log = logging.getLogger("replicadp")

MAX_REDIRECTS = 5
REDIRECTS = (301, 302, 303, 307, 308)
# How often the waiting thread checks the deadline and `cancelled()` (a Redis read each time).
POLL_S = 0.25
CHUNK = 64 * 1024
# Every failure of the remote side reads the same: refused, reset, not HTTP, a bad certificate, a banner.
FAILED = "download failed: no valid HTTP response"
SHARED = ipaddress.ip_network("100.64.0.0/10")  # carrier-grade NAT; Python's is_private leaves it out
NAT64 = ipaddress.ip_network("64:ff9b::/96")


def fetch(url: str, *, max_bytes: int, deadline_s: float, allow_nets: Sequence = (),
          cancelled: Callable[[], bool] | None = None, field: str = "image",
          bytes_setting: str = "REPLICADP_MAX_IMAGE_BYTES", deadline_setting: str = "REPLICADP_IMAGE_TIMEOUT") -> bytes:
    """The body behind `url`, at most `max_bytes`, within `deadline_s` in all (DNS, connect, headers, body, every
    redirect). Addresses that are not public are refused unless they lie in `allow_nets` (ip_network objects).
    `cancelled()` is polled every POLL_S; True raises RequestCancelled. Errors name `field` and the setting that
    bounds what was exceeded; any other failure raises FetchError."""
    named = (field, repr(url[:80]))  # an error's field and value
    label = "=".join(named)
    end = time.monotonic() + deadline_s
    download = _Download(url, named, max_bytes, allow_nets, bytes_setting, end)
    # The download runs in a thread of its own, so that this one answers at the deadline or a cancel whatever
    # the download is blocked in (a DNS lookup, a server sending a byte now and then); abort() then shuts its
    # socket down so that it stops too.
    runner = threading.Thread(target=download.run, name="replicadp-fetch", daemon=True)
    runner.start()
    late = FetchError(f"{label}: took longer than {deadline_s:g} s ({deadline_setting})", *named)
    try:
        while True:
            runner.join(max(0.0, min(POLL_S, end - time.monotonic())))
            if not runner.is_alive():
                break
            if cancelled is not None and cancelled():
                raise RequestCancelled(f"{label}: cancelled during the download")
            if time.monotonic() >= end:
                raise late
    finally:
        download.abort()
    if download.error is not None:
        # The download's socket times out at the deadline too, and may end first: that is still the deadline.
        raise late if time.monotonic() >= end else download.error
    return download.body


class _Download:
    """One fetch, hop by hop, in the runner thread; its outcome in `body` or `error`."""

    def __init__(self, url: str, named: tuple[str, str], max_bytes: int, allow_nets: Sequence, bytes_setting: str,
                 end: float):
        self.url, self.named, self.max_bytes, self.allow_nets = url, named, max_bytes, tuple(allow_nets)
        self.label = "=".join(named)
        self.bytes_setting, self.end = bytes_setting, end
        self.body: bytes = b""
        self.error: FetchError | None = None
        self._lock = threading.Lock()
        self._aborted = False
        self._guard: socket.socket | None = None  # a dup of the connection's socket, for abort()

    def abort(self) -> None:
        with self._lock:
            self._aborted = True
            if self._guard is not None:
                shut(self._guard)

    def failed(self, why: str) -> FetchError:
        return FetchError(f"{self.label}: {why}", *self.named)

    def run(self) -> None:
        try:
            self.body = self._follow()
        except FetchError as exc:
            self.error = exc
        except Exception as exc:  # whatever the remote side did; logged for the operator, never sent back
            log.info("%s: %s: %r", self.label, FAILED, exc)
            self.error = self.failed(FAILED)

    def _follow(self) -> bytes:
        url = self.url
        for hop in range(MAX_REDIRECTS + 1):
            # A redirect's target came from the remote side: named by its number, never echoed.
            where = f"redirect {hop}: " if hop else ""
            status, location, body = self._get(url, where, hop)
            if status not in REDIRECTS:
                return body
            if location is None:
                raise self.failed(f"{where}HTTP status {status} without a Location")
            url = urllib.parse.urljoin(url, location)
        raise self.failed(f"more than {MAX_REDIRECTS} redirects")

    def _get(self, url: str, where: str, hop: int) -> tuple[int, str | None, bytes]:
        """One request: (status, Location, body); the body only of a 2xx answer."""
        to = target(url, self.allow_nets, lambda why: self.failed(where + why), name_host=hop == 0)
        sock = self._connect(to.infos)
        try:
            if to.parts.scheme == "https":
                # Verified against the URL's host name; the address was checked above and is not looked up again.
                sock = ssl.create_default_context().wrap_socket(sock, server_hostname=to.ascii_host)
            return self._exchange(sock, to, where)
        finally:
            with self._lock:  # shut down, not only closed: http.client's response still holds the socket's file
                shut(self._guard)
                self._guard.close()
                self._guard = None
            sock.close()

    def _connect(self, infos) -> socket.socket:
        """A socket connected to one of the checked addresses (none looked up again: no DNS rebinding)."""
        error = None
        for family, type_, proto, _, sockaddr in infos:
            sock = socket.socket(family, type_, proto)
            # Per operation, so that the thread ends soon after the deadline even where abort() cannot reach
            # (a connect in progress); the deadline itself is fetch()'s.
            sock.settimeout(max(0.05, self.end - time.monotonic()))
            with self._lock:
                if self._aborted:
                    sock.close()
                    raise self.failed("aborted")
                self._guard = sock.dup()  # shutdown() on it stops the connection, even once wrapped in TLS
            try:
                sock.connect(sockaddr)
                return sock
            except OSError as exc:
                error = exc
                sock.close()
                with self._lock:
                    self._guard.close()
                    self._guard = None
        raise error  # run() logs it and answers FAILED

    def _exchange(self, sock, to: Target, where: str) -> tuple[int, str | None, bytes]:
        conn = http.client.HTTPConnection(to.ascii_host, to.port)
        conn.sock = sock  # already connected (and wrapped): http.client must not connect by itself
        try:
            conn.request("GET", to.path, headers={"Host": to.host_header, "User-Agent": "replicadp", "Accept": "*/*",
                                                  "Connection": "close"})
        except http.client.InvalidURL:
            raise self.failed(f"{where}not a valid URL") from None
        resp = conn.getresponse()
        if resp.status in REDIRECTS:
            return resp.status, resp.getheader("Location"), b""
        if not 200 <= resp.status < 300:
            raise self.failed(f"{where}HTTP status {resp.status}")
        too_big = self.failed(f"more than {self.max_bytes} bytes ({self.bytes_setting})")
        if resp.length is not None and resp.length > self.max_bytes:
            raise too_big
        body = bytearray()
        while chunk := resp.read(min(CHUNK, self.max_bytes + 1 - len(body))):
            body += chunk
            if len(body) > self.max_bytes:
                raise too_big
        return resp.status, None, bytes(body)


@dataclass(frozen=True)
class Target:
    """Where one request to a URL goes: its parts, its host as sent, its port and its host's addresses, each one
    checked. Connect only to these: looking the name up again could answer another address (DNS rebinding)."""

    parts: urllib.parse.SplitResult
    ascii_host: str
    port: int
    infos: list  # socket.getaddrinfo's answer

    @property
    def host_header(self) -> str:
        header = f"[{self.ascii_host}]" if ":" in self.ascii_host else self.ascii_host
        return header if self.port == (443 if self.parts.scheme == "https" else 80) else f"{header}:{self.port}"

    @property
    def path(self) -> str:
        return urllib.parse.urlunsplit(("", "", self.parts.path or "/", self.parts.query, ""))


def target(url: str, allow_nets: Sequence, failed: Callable[[str], Exception], name_host: bool = True,
           unresolved: Callable[[str], Exception] | None = None) -> Target:
    """The Target of `url`; else raises `failed(why)`: a scheme other than http(s), not a valid URL, a host that
    does not resolve (`unresolved(why)` if given: a lookup may fail for a moment), or one with an address that is
    not public and not in `allow_nets` (ip_network objects). `name_host`: whether `why` may name the host (not a
    redirect's: the remote side chose it)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise failed("scheme not allowed; only http and https")
    try:
        host, port = parts.hostname, parts.port
        if port is None:
            port = 443 if parts.scheme == "https" else 80
        if not host:
            raise ValueError("no host")
        ascii_host = host.encode("idna").decode("ascii")
    except (ValueError, UnicodeError):
        raise failed("not a valid URL") from None
    named = f"host {host[:80]!r}" if name_host else "its host"
    try:
        infos = socket.getaddrinfo(ascii_host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        raise (unresolved or failed)(f"{named} does not resolve") from None
    for info in infos:  # every address: a name with one public and one internal address is refused
        refusal = _refusal(info[4][0], tuple(allow_nets))
        if refusal:
            # The address of a literal is what the URL says; a name's is what this side's resolver said, which an
            # error must not tell (a DNS oracle of the internal network): not even its range.
            if not _is_literal(ascii_host):
                raise failed(f"an address of {named} is not public, not allowed (REPLICADP_FETCH_ALLOW)")
            raise failed(f"address {info[4][0]} of {named} is {refusal}, not allowed (REPLICADP_FETCH_ALLOW)")
    return Target(parts, ascii_host, port, infos)


def _is_literal(host: str) -> bool:
    """Whether `host` is an IP address in any spelling the resolver takes without a lookup ('2130706433' too)."""
    try:
        socket.getaddrinfo(host, None, flags=socket.AI_NUMERICHOST)
    except (OSError, UnicodeError):
        return False
    return True


def _refusal(address: str, allow_nets: tuple) -> str | None:
    """Why `address` may not be fetched from, or None: public, or inside an allowed network."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # an IPv6 scope id is no part of the address
    if ip.version == 6:
        # An IPv4 address carried inside an IPv6 one is the IPv4 host.
        embedded = ip.ipv4_mapped or ip.sixtofour or (ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
                                                      if ip in NAT64 else None)
        ip = embedded or ip
    if any(ip in net for net in allow_nets):
        return None
    for reason, internal in (("unspecified", ip.is_unspecified), ("loopback", ip.is_loopback),
                             ("link-local", ip.is_link_local), ("multicast", ip.is_multicast),
                             ("shared address space", ip in SHARED),
                             ("reserved", ip.is_reserved), ("private", ip.is_private),
                             ("not globally routable", not ip.is_global)):
        if internal:
            return reason
    return None


def shut(sock: socket.socket) -> None:
    """Shut `sock` down both ways: a read or write blocked on it in another thread returns."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # not connected yet, or already closed
        pass
