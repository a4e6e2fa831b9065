"""Starting and stopping a set of replicas through worker_launch.sh, and `up` / `down` state."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import redis

from replicadp_tasks.cluster import connection, fleet
from replicadp_tasks.contract import InvalidRequest, check_model_name
from replicadp_tasks.settings import SETTINGS, STATE_DIR, STATE_FILE

from ..api import live_replicas, use_redis
from .embedded import SUPERVISOR_PID, EmbeddedServer, die_with_parent, is_supervisor, stop_pid
from .ha import HAStack

LAUNCHER = Path(__file__).resolve().parents[2] / "worker_launch.sh"


def replica_names(n: int, first: int = 0) -> list[str]:
    return [f"replica{i}@{socket.gethostname()}" for i in range(first, first + n)]


class Replicas:
    """N replicas of one model run by one worker_launch.sh process (its own process group), named from
    replica<first>."""

    def __init__(self, n: int, *, redis_url: str, model: str, devices: str = "cpu", threads: int | None = None,
                 gpus_per_replica: int = 1, log_path: Path, env: dict | None = None, detach: bool = False,
                 first: int = 0):
        self.n, self.first, self.log_path, self.redis_url, self.detach = n, first, Path(log_path), redis_url, detach
        self.env = {
            **os.environ,
            # The launcher runs `celery` from this interpreter's environment.
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "REDIS_URL": redis_url, "REPLICADP_MODEL": model, "NUM_REPLICAS": str(n), "DEVICES": devices,
            "GPUS_PER_REPLICA": str(gpus_per_replica), "FIRST_REPLICA": str(first), **(env or {}),
        }
        self.model = self.env.get("REPLICADP_SERVED_MODEL_NAME") or model  # the name its requests give
        if threads:
            self.env["THREADS_PER_REPLICA"] = str(threads)
        self.proc: subprocess.Popen | None = None
        self.declared: list[str] = []  # the models its start declared (cluster/fleet.py)
        self.log_start = 0  # the log's size when the launcher last started: what it wrote since is past it

    @property
    def names(self) -> list[str]:
        return replica_names(self.n, self.first)

    def start(self, timeout: float = 300.0) -> "Replicas":
        """Declare their model (cluster/fleet.py: requests for it wait while they load), start the replicas and
        return once each holds its model and consumes its queue; RuntimeError as soon as one exits before that (a
        bad model spec, a misconfigured broker: the launcher would restart it forever)."""
        self.declared = fleet.declare(connection.client(self.redis_url), [self.model],
                                      self.env.get("REPLICADP_QUEUE") or SETTINGS.queue, "replicadp up")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.log_start = log.tell()
            # Its own session: stop() can end the launcher and every replica as one group.
            self.proc = subprocess.Popen(["bash", str(LAUNCHER), "--loglevel", "INFO"], env=self.env, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                         preexec_fn=None if self.detach else die_with_parent)
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout: float) -> None:
        """Until every replica's heartbeat says it serves (a Redis read, so polled often). A read that times out
        is asked again: on a loaded machine an fsynced server can stall past the read's 1 s, and that says
        nothing about the replicas."""
        deadline = time.monotonic() + timeout
        want = set(self.names)
        while not want <= self.serving():
            # A replica's exit before the launcher's: the launcher reports it, and ends too once no replica is left
            # to supervise (one that cannot load its model is not restarted). Its log is read after its poll: an
            # ended launcher has written its line.
            launcher = self.proc.poll()
            if self.exited_early():
                raise RuntimeError(f"a replica exited before it served; see {self.log_path}:\n" + tail(self.log_path))
            if launcher is not None:
                raise RuntimeError(f"worker_launch.sh exited ({launcher}); see {self.log_path}:\n"
                                   + tail(self.log_path))
            if time.monotonic() > deadline:
                raise TimeoutError(f"replicas not ready after {timeout:.0f} s; see {self.log_path}:\n" + tail(self.log_path))
            time.sleep(0.1)

    def serving(self) -> set[str]:
        """The replicas the heartbeats list as serving; none when the read timed out."""
        try:
            return set(live_replicas(url=self.redis_url))
        except redis.exceptions.TimeoutError:
            return set()

    def exited_early(self) -> bool:
        """Whether the launcher has reported a replica's exit since this start (worker_launch.sh's restart line)."""
        with open(self.log_path, "rb") as log:
            log.seek(self.log_start)
            return re.search(rb"^worker_launch\.sh: replica\d+ exited with status", log.read(), re.M) is not None

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM (replicas finish their running request), then SIGKILL the group if it lingers; then take back
        the model's declaration if `start` made it and no replica of the model is left (a later deployment of
        another model on this Redis is not made ambiguous by it)."""
        if self.proc is None:
            return
        stop_group(self.proc.pid, timeout, self.proc)
        self.proc.wait()
        self.proc = None
        forget_unserved(self.redis_url, self.declared)
        self.declared = []

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def forget_unserved(url: str, models: list[str]) -> None:
    """Take back the declarations of `models` that no live replica serves (cluster/fleet.py). A Redis that cannot be
    reached keeps them (`replicadp forget-model` takes one back)."""
    try:
        for model in models:
            if not live_replicas(url=url, model=model):
                fleet.forget(connection.client(url), model)
    except redis.exceptions.RedisError:
        pass


def scratch_run(stack: ExitStack, prefix: str, url: str | None = None,
                log=lambda message: None) -> tuple[Path, str]:
    """A temporary run folder and a Redis URL for a self-contained run (the demo, a sweep): `url` if given
    (their --redis-url, else REDIS_URL), else an embedded server in the folder. Both are cleaned up when `stack`
    closes; this process's app is pointed at the URL."""
    run_dir = Path(tempfile.mkdtemp(prefix=prefix))
    stack.callback(shutil.rmtree, run_dir, ignore_errors=True)
    # Importing diffusers imports torch._dynamo, which creates torch's inductor cache folder in every process that
    # does (by default $TMPDIR/torchinductor_<user>, left behind empty): this one's and its replicas' go in here.
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(run_dir / "torchinductor")
        stack.callback(os.environ.pop, "TORCHINDUCTOR_CACHE_DIR", None)
    if not url:
        server = EmbeddedServer(run_dir / "redis")
        url = server.start()
        stack.callback(server.stop)
        log(f"embedded Valkey on 127.0.0.1:{server.port} (password-protected, append-only, in {run_dir})")
    use_redis(url)
    return run_dir, url


def stop_group(pgid: int, timeout: float, leader: subprocess.Popen | None = None) -> None:
    """End a process group that we started: SIGTERM to its leader, SIGKILL to the group after `timeout`.
    `leader` is the group leader's Popen when it is our child, so that it is reaped, not left a zombie."""
    try:
        os.kill(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if leader is not None:
            leader.poll()
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# --- `replicadp up` / `replicadp down`: the same, detached, with the PIDs in STATE_FILE ---------------

def visible_gpus() -> list[str]:
    """The GPU ids this process may use: CUDA_VISIBLE_DEVICES when it is set (empty: none), else every GPU that
    nvidia-smi lists, as worker_launch.sh picks them (not torch: importing it costs `up` seconds)."""
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        return [d.strip() for d in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
    try:
        run = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return run.stdout.split() if run.returncode == 0 else []


def plan(devices: str, replicas: int | None, gpus_per_replica: int, visible: list[str]) -> tuple[str, int]:
    """worker_launch.sh's DEVICES and NUM_REPLICAS for `up --devices --replicas` (None: one replica per
    `gpus_per_replica` GPUs, or 1 on the CPU). `auto`: the first GPUs of `visible` that the replicas need, or the
    CPU when none is visible. ValueError names the option that does not fit."""
    if replicas is not None and replicas < 1:
        raise ValueError(f"--replicas {replicas}: must be at least 1")
    if devices == "auto":
        if not visible:
            return "cpu", replicas or 1
        n = replicas or len(visible) // gpus_per_replica
        if n < 1 or n * gpus_per_replica > len(visible):
            raise ValueError(f"--devices auto: {len(visible)} GPU(s) visible ({','.join(visible)}), too few for "
                             f"{max(n, 1)} replica(s) of {gpus_per_replica} GPU(s)")
        return ",".join(visible[:n * gpus_per_replica]), n
    if devices == "cpu":
        return "cpu", replicas or 1
    ids = devices.split(",")
    if not all(i.isascii() and i.isdigit() for i in ids):
        raise ValueError(f"--devices {devices!r}: expected auto, cpu or GPU ids like 0,1,2,3")
    return devices, replicas or max(1, len(ids) // gpus_per_replica)


@dataclass(frozen=True)
class Group:
    """One model's replicas in a stack that `up` starts: `n` of `model` (a spec) on `devices`, its requests naming
    it `served_name` (None: the spec), with its own adapter registry and recipe where given (None: the
    environment's REPLICADP_LORAS and REPLICADP_RECIPE; "": none)."""

    model: str
    n: int
    devices: str
    served_name: str | None = None
    auto: bool = False  # the devices were `--devices auto`'s choice
    loras: str | None = None
    recipe: str | None = None

    @property
    def env(self) -> dict[str, str]:
        """What its replicas' environment has of its own."""
        named = {"REPLICADP_SERVED_MODEL_NAME": self.served_name, "REPLICADP_LORAS": self.loras,
                 "REPLICADP_RECIPE": self.recipe}
        return {name: value for name, value in named.items() if value is not None}


def fleet_plan(models: tuple, served_names: tuple, counts: tuple, devices: tuple, gpus_per_replica: int,
               visible: list[str], loras: tuple = (), recipes: tuple = ()) -> list[Group]:
    """`up --model ... [--served-model-name] [--replicas] [--devices] [--loras] [--recipe]`'s groups, one a model:
    each option's values go with the models in their order, one value with every model (`none` for --loras and
    --recipe: none for that model); `auto` devices are the `visible` GPUs that the models before left. ValueError
    names the option that does not fit."""
    def each(option: str, values: tuple, default) -> list:
        if len(values) > 1 and len(values) != len(models):
            raise ValueError(f"{option} given {len(values)} times for {len(models)} --model: give it once (for every "
                             "model) or once per --model")
        return list(values) * len(models) if len(values) == 1 else list(values) or [default] * len(models)

    names = [name or None for name in each("--served-model-name", served_names, "")]
    served = [name or model for name, model in zip(names, models)]
    for name, model in zip(names, served):
        try:
            check_model_name(model, "--served-model-name" if name else "--model")
        except InvalidRequest as exc:
            raise ValueError(f"{exc} (a model's name; give it another with --served-model-name)") from None
    twice = next((name for name in served if served.count(name) > 1), None)
    if twice is not None:
        raise ValueError(f"two --model serve {twice!r}: give each a --served-model-name of its own")
    groups, taken = [], set()
    own = [[None if v is None else "" if v == "none" else v for v in each(option, values, None)]
           for option, values in (("--loras", loras), ("--recipe", recipes))]
    for model, name, n, where, registry, recipe in zip(models, names, each("--replicas", counts, None),
                                                       each("--devices", devices, "auto"), *own):
        chosen, n = plan(where, n, gpus_per_replica, [g for g in visible if g not in taken])
        ids = set() if chosen == "cpu" else set(chosen.split(","))
        if ids & taken:
            raise ValueError(f"--devices {where}: GPU {','.join(sorted(ids & taken))} is given to another --model too")
        taken |= ids
        groups.append(Group(model, n, chosen, name, auto=where == "auto", loras=registry, recipe=recipe))
    return groups


def up(groups: list[Group], threads: int | None, gpus_per_replica: int, timeout: float, ha: bool = False) -> dict:
    """Start the embedded server (`ha`: the HA stack of ha.py) unless REDIS_URL is set, and each group's replicas,
    one launcher a group, numbered one after another."""
    if STATE_FILE.exists():
        raise RuntimeError(f"already up (state in {STATE_FILE}); run `replicadp down` first")
    run_dir = STATE_DIR / "run"
    state = {"run_dir": str(run_dir), "models": [g.served_name or g.model for g in groups], "replicas": [],
             "launcher_pids": []}
    server = None
    redis_url = os.environ.get("REDIS_URL")
    if redis_url and ha:
        raise RuntimeError("--ha starts a Redis of its own: unset REDIS_URL (or drop --ha to use that Redis)")
    if not redis_url:
        server = HAStack(run_dir / "redis-ha") if ha else EmbeddedServer(run_dir / "redis")
        redis_url = server.start(detach=True)
        # Each server's supervisor (it restarts the server if it dies); its conf identifies it for `down`.
        state["servers"] = [{"pid": s.proc.pid, "conf": str(s.conf_path)}
                            for s in (server.sentinels + server.nodes if ha else [server])]
    state["redis_url"] = redis_url
    try:
        _write_state(state)  # before the replicas start, so `down` can always clean up
        first = 0
        for i, group in enumerate(groups):
            replicas = Replicas(group.n, redis_url=redis_url, model=group.model, devices=group.devices,
                                threads=threads, gpus_per_replica=gpus_per_replica, detach=True, first=first,
                                log_path=run_dir / ("replicas.log" if i == 0 else f"replicas-{i}.log"),
                                env=group.env)
            replicas.start(timeout)
            state["declared"] = state.get("declared", []) + replicas.declared
            state["launcher_pids"].append(replicas.proc.pid)
            state["replicas"] += replicas.names
            _write_state(state)
            first += group.n
    except BaseException:
        for pid in state["launcher_pids"]:
            stop_group(pid, timeout=60)
        forget_unserved(redis_url, state.get("declared", []))
        if server:
            server.stop()
        STATE_FILE.unlink(missing_ok=True)
        raise
    return state


def down() -> dict | None:
    try:
        state = json.loads(STATE_FILE.read_text())
    except FileNotFoundError:
        return None
    for pid in state.get("launcher_pids", []):
        if _is_launcher(pid):
            stop_group(pid, timeout=60)
    forget_unserved(state["redis_url"], state.get("declared", []))
    _stop_server(state)
    STATE_FILE.unlink(missing_ok=True)
    return state


def _is_launcher(pid: int) -> bool:
    """Whether `pid` still runs worker_launch.sh (not a PID reused since a stale state file was written)."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(arg.endswith(LAUNCHER.name.encode()) for arg in args)


def _stop_server(state: dict) -> None:
    """Stop up's server supervisors (each stops its server or Sentinel): the one in the state and the one in its
    run folder's pid file (started by hand), each only if it still is a supervisor of that server (not a reused
    PID)."""
    for server in state.get("servers", []):
        conf = Path(server["conf"])
        pids = {server.get("pid")}
        try:
            pids.add(int((conf.parent / SUPERVISOR_PID).read_text()))
        except (OSError, ValueError):
            pass
        for pid in pids - {None}:
            if is_supervisor(pid, conf):
                stop_pid(pid)


def _write_state(state: dict) -> None:
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    tmp = STATE_FILE.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    tmp.chmod(0o600)  # it holds the Redis password
    tmp.replace(STATE_FILE)
