"""Chaos benchmark: a batch against real replicas while pool children, whole replicas, follower ranks (with
--parallel) and Redis are killed at random moments, replicas are stopped (SIGSTOP, then SIGCONT: a frozen or
partitioned host) and malformed messages are pushed onto the queue; with --ha, a Redis that fails over instead
of one server, whose primary is killed, stopped until Sentinel promotes another, or frozen for a set time (a
paused VM, a partition), and whose Sentinels are killed. Prints requests submitted / completed / failed / lost /
computed more than once, and the recovery time of each kind of fault (median and max); writes JSON.

    .venv/bin/python bench/chaos.py --replicas 3 --requests 60 --out bench-results/chaos.json
    .venv/bin/python bench/chaos.py --replicas 2 --parallel ulysses:2 --faults follower,child,redis \
        --out bench-results/chaos-parallel.json                                       # replicas of 2 ranks
    .venv/bin/python bench/chaos.py --ha --replicas 2 --requests 120 --out bench-results/chaos-ha.json
    .venv/bin/python bench/chaos.py --ha --faults primary-freeze --freeze 20 --out bench-results/chaos-freeze.json

Recovery time of a fault: from the kill or stop until the request it interrupted has completed (a child or
replica kill, a stop), or until the next request completes (a Redis kill: the server is down for `--redis-down`
seconds; a poison message; a fault of the HA stack, from the moment it strikes: the primary or Sentinel killed
comes back after `--redis-down` seconds, the stopped primary once another is promoted, the frozen one after
`--freeze` seconds, whatever Sentinel did meanwhile).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import click
import redis
from kombu.exceptions import OperationalError
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from client.api import run_requests, use_redis  # noqa: E402
from client.cli import size_param  # noqa: E402
from client.local.embedded import EmbeddedServer  # noqa: E402
from client.local.ha import HAStack  # noqa: E402
from client.local.replicas import Replicas  # noqa: E402
from replicadp_tasks.cluster import connection, outage_tolerant  # noqa: E402
from replicadp_tasks.contract import RequestState, queue_for  # noqa: E402
from replicadp_tasks.contract.keys import ATTEMPTS_KEY, STATS_KEY  # noqa: E402
from replicadp_tasks.settings import SETTINGS  # noqa: E402

QUEUE = queue_for(SETTINGS.queue, "tiny")  # the queue of the model the chaos replicas serve

FAULTS = ("child", "replica", "redis", "poison", "stop-main", "stop-child", "stop-both", "follower",
          "primary-kill", "primary-stop", "primary-freeze", "sentinel-kill")
# Of the HA stack (--ha), which the others are not.
HA_FAULTS = ("primary-kill", "primary-stop", "primary-freeze", "sentinel-kill")
PROMOTION_WAIT_S = 30.0  # primary-stop: the primary stays stopped until Sentinel promotes another, at most this
# Messages that each crashed a replica's main process, looped its consumer or were never answered, before
# replicas checked what they pop (replicadp_tasks/broker/message.py).
POISON = (b"{not json", b"[1, 2, 3]",
          json.dumps({"body": "%%%", "content-encoding": "utf-8", "content-type": "application/json",
                      "headers": {"task": "replicadp.generate"}, "properties": {"delivery_tag": None}}).encode(),
          json.dumps({"body": "ImFiYyI=", "content-encoding": "utf-8", "content-type": "application/json",
                      "headers": {"task": "replicadp.generate", "id": "chaos-poison", "timelimit": "abc",
                                  "eta": "2999-01-01T00:00:00+00:00"},
                      "properties": {"delivery_tag": "chaos", "body_encoding": "base64",
                                     "delivery_info": {"exchange": "", "routing_key": "video"}}}).encode())


def parent_of(pid: int) -> int:
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])


def children_of(pid: int) -> list[int]:
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if parent_of(int(proc.name)) == pid:
                found.append(int(proc.name))
        except (OSError, IndexError):  # gone meanwhile
            pass
    return found


def wait_serving(names: list[str], timeout: float = 120.0) -> int:
    """How many of the replicas `names` consume their model's queue again, waiting up to `timeout` for all of them
    (after the last fault, a replica may still be reloading its model)."""
    from replicadp_tasks import app

    deadline = time.monotonic() + timeout
    while True:
        try:  # a connection of its own: the pooled ones may predate the last Redis restart
            with app.connection_for_write() as conn:
                replies = app.control.inspect(destination=names, timeout=2, connection=conn).active_queues() or {}
        except (redis.RedisError, OperationalError, OSError):
            replies = {}
        serving = sum(any(q["name"] == QUEUE for q in replies.get(name) or []) for name in names)
        if serving == len(names) or time.monotonic() > deadline:
            return serving
        time.sleep(1)


def running(client: redis.Redis) -> list[tuple[str, dict]]:
    """(task id, PROGRESS info) of every request being computed now (a killed one keeps reading PROGRESS
    until it is computed again: skip those whose process is gone)."""
    out = []
    for key in client.scan_iter("celery-task-meta-*", count=1000):
        meta = json.loads(client.get(key) or "{}")
        if meta.get("status") == RequestState.PROGRESS and os.path.exists(f"/proc/{meta['result']['pid']}"):
            out.append((meta["task_id"], meta["result"]))
    return out


class Chaos:
    """Kills something every `interval` seconds (randomised) until stopped; records each fault."""

    def __init__(self, server: EmbeddedServer | HAStack, seed: int, interval: float, redis_down: float, stop_s: float,
                 freeze_s: float, kinds):
        self.server, self.interval, self.redis_down, self.stop_s, self.kinds = server, interval, redis_down, stop_s, kinds
        self.freeze_s = freeze_s
        self.rng = random.Random(seed)
        self.faults: list[dict] = []
        self.stop = threading.Event()
        self.striking = threading.Lock()  # held during a fault: the batch's figures are read between faults
        # A restarted server dies with the thread that started it (PR_SET_PDEATHSIG is per thread): this
        # thread outlives the run until the server has been stopped.
        self.release = threading.Event()

    def client(self) -> redis.Redis:
        return connection.client(self.server.url, socket_timeout=2, socket_connect_timeout=2)

    def run(self) -> None:
        while not self.stop.wait(self.rng.uniform(0.5, 1.5) * self.interval):
            with self.striking:
                try:
                    self.strike(self.rng.choice(self.kinds))
                except (redis.RedisError, OSError, ValueError) as exc:  # nothing running, a pid gone meanwhile
                    print(f"chaos: skipped a fault ({exc})", file=sys.stderr)
        self.release.wait()

    def strike(self, kind: str) -> None:
        if kind == "redis":
            os.kill(self.server.proc.pid, signal.SIGKILL)
            self.server.proc.wait()
            at = time.time()
            time.sleep(self.redis_down)
            self.server = EmbeddedServer(self.server.data_dir, port=self.server.port, password=self.server.password)
            self.server.start()
            self.faults.append({"kind": kind, "at": at, "task_id": None, "down_s": self.redis_down})
            return
        if kind in ("primary-kill", "sentinel-kill"):  # down for --redis-down, then back in the role it is given
            victim = self.server.primary() if kind == "primary-kill" else self.rng.choice(self.server.sentinels)
            os.kill(victim.proc.pid, signal.SIGKILL)
            victim.proc.wait()
            self.faults.append({"kind": kind, "at": time.time(), "task_id": None, "down_s": 0.0})
            time.sleep(self.redis_down)
            victim.start(configure=False)
            self.server.wait_settled(60)  # the next fault strikes a whole stack
            return
        if kind == "primary-stop":  # stopped until Sentinel promotes another, then resumed
            primary = self.server.primary()
            os.kill(primary.proc.pid, signal.SIGSTOP)
            self.faults.append({"kind": kind, "at": time.time(), "task_id": None, "down_s": 0.0})
            deadline = time.monotonic() + PROMOTION_WAIT_S
            try:
                while self.server.master_address()[1] == primary.port and time.monotonic() < deadline:
                    time.sleep(0.05)
            finally:
                os.kill(primary.proc.pid, signal.SIGCONT)
            self.server.wait_settled(60)
            return
        if kind == "primary-freeze":  # stopped for --freeze seconds, whatever Sentinel does meanwhile
            primary = self.server.primary()
            os.kill(primary.proc.pid, signal.SIGSTOP)
            at = time.time()
            fault = {"kind": kind, "at": at, "task_id": None, "down_s": 0.0, "freeze_s": self.freeze_s}
            try:
                while time.time() < at + self.freeze_s:
                    if "promoted_s" not in fault and self.server.master_address()[1] != primary.port:
                        fault["promoted_s"] = round(time.time() - at, 2)
                    time.sleep(0.05)
            finally:
                os.kill(primary.proc.pid, signal.SIGCONT)
            self.faults.append(fault)
            self.server.wait_settled(60)
            return
        if kind == "poison":
            self.client().lpush(QUEUE, self.rng.choice(POISON))
            self.faults.append({"kind": kind, "at": time.time(), "task_id": None, "down_s": 0.0})
            return
        busy = running(self.client())
        if not busy:
            return
        task_id, info = self.rng.choice(busy)
        child, main = info["pid"], parent_of(info["pid"])
        fault = {"kind": kind, "at": time.time(), "task_id": task_id, "replica": info["replica"], "step": info["step"]}
        if kind.startswith("stop-"):
            pids = {"stop-main": [main], "stop-child": [child], "stop-both": [main, child]}[kind]
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            try:
                time.sleep(self.stop_s)  # the stop itself
            finally:
                for pid in pids:
                    os.kill(pid, signal.SIGCONT)
        elif kind == "follower":  # a rank of a replica over several (REPLICADP_PARALLEL)
            followers = [pid for pid in children_of(child) if b"replicadp_tasks.model.follower" in
                         Path(f"/proc/{pid}/cmdline").read_bytes()]
            if not followers:
                raise ValueError(f"{info['replica']} runs no follower rank now (its group may be rebuilding)")
            os.kill(self.rng.choice(followers), signal.SIGKILL)
        else:
            os.kill(child if kind == "child" else main, signal.SIGKILL)
        self.faults.append(fault)


@click.command()
@click.option("--replicas", "n", default=3, show_default=True)
@click.option("--requests", "count", default=60, show_default=True)
@click.option("--concurrency", default=0, help="In flight at most; 0 = 2 x replicas.")
@click.option("--size", default="128x128", show_default=True, callback=size_param)
@click.option("--num-frames", default=17, show_default=True)
@click.option("--steps", default=20, show_default=True)
@click.option("--interval", default=6.0, show_default=True, help="Mean seconds between faults.")
@click.option("--redis-down", default=2.0, show_default=True, help="Seconds Redis stays down when killed.")
@click.option("--stop", "stop_s", default=15.0, show_default=True,
              help="Seconds a stopped replica stays stopped (more than the 6 s lease: its requests are requeued).")
@click.option("--freeze", "freeze_s", default=30.0, show_default=True,
              help="Seconds a frozen primary (primary-freeze) stays stopped: longer than Sentinel's failover.")
@click.option("--faults", "kinds", help=f"Kinds of fault to draw from: {', '.join(FAULTS)}. Default: those of "
              "replicas and Redis but follower (which needs --parallel); with --ha, " + ", ".join(HA_FAULTS) + ".")
@click.option("--parallel", default="none", show_default=True,
              help="REPLICADP_PARALLEL of the replicas (ulysses:2: each replica two processes; the follower fault).")
@click.option("--ha", is_flag=True, help="Redis that fails over (a primary, two replicas, three Sentinels: "
              "client/local/ha.py) instead of one server; its faults: " + ", ".join(HA_FAULTS) + ".")
@click.option("--seed", default=1, show_default=True)
@click.option("--timeout", default=300.0, show_default=True, help="Seconds after which a request counts as lost.")
@click.option("--out", default="bench-results/chaos.json", show_default=True, type=click.Path(path_type=Path))
def main(n, count, concurrency, size, num_frames, steps, interval, redis_down, stop_s, freeze_s, kinds, parallel, ha,
         seed, timeout, out):
    console = Console(width=None if sys.stdout.isatty() else 160)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the replicas, remove the run folder
    width, height = size
    if kinds is None:
        kinds = ",".join(HA_FAULTS if ha else (f for f in FAULTS if f not in ("follower", *HA_FAULTS)))
    kinds = tuple(k for k in kinds.split(",") if k)
    if not set(kinds) <= set(FAULTS):
        raise click.BadParameter(f"{kinds}: each must be one of {FAULTS}", param_hint="--faults")
    if "follower" in kinds and parallel == "none":
        raise click.BadParameter("the follower fault needs replicas of several ranks: --parallel ulysses:2",
                                 param_hint="--faults")
    if ha and "redis" in kinds or not ha and set(kinds) & set(HA_FAULTS):
        raise click.BadParameter(f"{', '.join(HA_FAULTS)} strike the HA stack (--ha), redis one server (no --ha)",
                                 param_hint="--faults")
    run_dir = Path(tempfile.mkdtemp(prefix="replicadp-chaos-"))
    server = HAStack(run_dir / "redis-ha") if ha else EmbeddedServer(run_dir / "redis")
    chaos, outcomes, serving, twice = None, [], 0, 0
    try:
        url = server.start()
        use_redis(url)
        # TMPDIR in the run folder: a SIGKILLed replica cannot remove its prefork pool's pymp-* folder.
        (run_dir / "tmp").mkdir()
        group = Replicas(n, redis_url=url, model="tiny", threads=1, log_path=run_dir / "replicas.log",
                         env={"OUTPUT_DIR": str(run_dir / "out"), "REPLICADP_MAX_ATTEMPTS": "5",
                              "TMPDIR": str(run_dir / "tmp"), "REPLICADP_PARALLEL": parallel}).start()
        try:
            # Every priority and four users (one unnamed) mixed: requeues go back to the head of their own
            # priority's list, and the round robin places each new request among them.
            requests = [{"prompt": f"chaos {i}", "seed": i, "height": height, "width": width,
                         "num_frames": num_frames, "num_inference_steps": steps,
                         "priority": ("interactive", "normal", "batch")[i % 3],
                         "user": ("a", "b", "c", None)[i % 4]} for i in range(count)]
            chaos = Chaos(server, seed, interval, redis_down, stop_s, freeze_s, kinds)
            thread = threading.Thread(target=chaos.run, daemon=True)
            started = time.time()
            thread.start()
            with console.status("") as status:
                for o in run_requests(requests, concurrency=concurrency or 2 * n, timeout=timeout):
                    outcomes.append(o)
                    status.update(f"{len(outcomes)}/{count} done, {len(chaos.faults)} faults")
            chaos.stop.set()
            with chaos.striking:  # a fault under way has ended (Redis is up again)
                pass
            elapsed = time.time() - started
            client = outage_tolerant(chaos.server.url, 30)  # the last fault may have just restarted Redis
            starts = {o.task_id: int(client.get(ATTEMPTS_KEY + o.task_id) or 0) for o in outcomes}
            twice = int(client.hget(STATS_KEY, "duplicate_executions") or 0)
            refused = int(client.hget(STATS_KEY, "refused_messages") or 0)
            serving = wait_serving(group.names)  # none left paused (a killed child's replica) or stuck
        finally:
            group.stop()
    finally:
        (chaos.server if chaos else server).stop()
        if chaos:
            chaos.release.set()
        if chaos and all(o.ok for o in outcomes) and len(outcomes) == count and serving == n and not twice:
            shutil.rmtree(run_dir, ignore_errors=True)
        else:
            print(f"chaos: kept {run_dir} (logs, Redis data) for a look", file=sys.stderr)

    done_at = {o.task_id: o.finished_at for o in outcomes if o.ok}
    completions = sorted(done_at.values())
    for f in chaos.faults:
        if f["task_id"] is not None:
            end = done_at.get(f["task_id"])
        else:
            end = next((t for t in completions if t > f["at"] + f["down_s"]), None)
        f["recovery_s"] = round(end - f["at"], 2) if end else None
    failed = [o for o in outcomes if not o.ok and not o.error.startswith("timed out")]
    lost = count - sum(o.ok for o in outcomes) - len(failed)
    report = {
        "replicas": n, "parallel": parallel, "ha": ha, "requests": count, "size": f"{width}x{height}", "num_frames": num_frames, "steps": steps,
        "interval_s": interval, "redis_down_s": redis_down, "freeze_s": freeze_s, "seed": seed,
        "elapsed_s": round(elapsed, 1),
        "submitted": count, "completed": sum(o.ok for o in outcomes), "failed": len(failed), "lost": lost,
        "computed_more_than_once": twice, "started_more_than_once": sum(s > 1 for s in starts.values()),
        "poison_pushed": sum(f["kind"] == "poison" for f in chaos.faults), "poison_refused": refused,
        "replicas_serving_at_end": serving,
        "errors": sorted({o.error for o in failed}),
        "recovery": {}, "faults": chaos.faults,
    }
    table = Table(title=f"chaos: {n} replicas, {count} requests, {len(chaos.faults)} faults in {elapsed:.0f} s"
                  + (" (Redis: primary, 2 replicas, 3 Sentinels)" if ha else ""))
    for col in ("fault", "count", "recovered", "median recovery", "max recovery"):
        table.add_column(col, justify="right")
    for kind in kinds:
        times = [f["recovery_s"] for f in chaos.faults if f["kind"] == kind]
        ok = [t for t in times if t is not None]
        report["recovery"][kind] = {"count": len(times), "recovered": len(ok),
                                    "median_s": statistics.median(ok) if ok else None, "max_s": max(ok) if ok else None}
        table.add_row(kind, str(len(times)), str(len(ok)), f"{statistics.median(ok):.1f} s" if ok else "-",
                      f"{max(ok):.1f} s" if ok else "-")
    console.print(table)
    console.print(f"submitted {count}, completed {report['completed']}, failed {len(failed)}, lost {lost}, "
                  f"computed more than once {twice}, started more than once {report['started_more_than_once']}; "
                  f"replicas serving at the end {serving}/{n}; poison messages refused {refused} of "
                  f"{report['poison_pushed']}")
    for error in report["errors"]:
        console.print(f"  failed: {error}")
    for o in outcomes:
        if not o.ok:
            console.print(f"  not completed: {o.task_id} {o.request['prompt']!r}: {o.error}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    console.print(f"JSON: {out}")
    sys.exit(0 if report["completed"] == count and twice == 0 and serving == n
             and refused == report["poison_pushed"] else 1)


if __name__ == "__main__":
    main()
