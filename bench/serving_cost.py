"""What a request costs beyond its compute: one replica of the synthetic backend (128x128, 33 frames) kept busy with
2 requests in flight, on the embedded server (`appendfsync always`). Per request: the time (the first request sent
to the last one answered, over the requests), the CPU time of each process (the client, the replica's main
process, its pool child, Redis), Redis commands (in all and by name) and round trips (the server's reads), at 1
step and at more (the difference, per step); and where one request's time goes, from Celery's task events and the
records its replica writes (docs/http.md, `phase`): the producer's send, the wait behind the request ahead (2 are
in flight), the main process's hand-over to the pool child, inputs and fence, denoising, decoding (the compute
after the steps and the synthetic frames; with the finisher, also its wait for the next request's compute to
begin), encoding, storing and the result, the client's wake-up (and beside it, the result's way back to the main
process).

`--compute-ms 0` (the default, `synthetic:0`): nothing to compute, so a request's time is all serving cost, the
work a GPU host's CPUs do beside the GPU (the encode above all) included. `--compute-ms C` (`synthetic:0:C/1000`):
each request computes for C ms off the CPU after its steps, as a GPU decodes its latents, and what a request costs
beyond its compute is its time less C: the time the compute waits for.

With `--baseline REV`, the same runs on commit REV (a git worktree: its replica, its client) in alternate rounds:
before and after in one run. `--profile DIR` records the replica's two processes with py-spy (this tree, first
round at 1 step) into flame graphs. Prints tables and writes JSON.

    .venv/bin/python bench/serving_cost.py --requests 200 --rounds 3 --compute-ms 50 --baseline 942ad0f \\
        --out bench-results/serving-cost-round4-compute50.json
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from datetime import datetime
from pathlib import Path

import click
import redis
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from client.local.embedded import EmbeddedServer, die_with_parent  # noqa: E402
from client.local.replicas import stop_group  # noqa: E402

SHAPE = {"height": 128, "width": 128, "num_frames": 33}
WARM_UP = 20
# The client, run with a tree's code: sends the requests (2 in flight) and says when each was sent and seen done.
CLIENT = """
import json, resource, sys, time
from client.api import run_requests
steps, n, warm = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
shape = json.loads(sys.argv[4])
make = lambda i: {"prompt": f"request {i}", **shape, "num_inference_steps": steps, "seed": i}
list(run_requests([make(i) for i in range(warm)], concurrency=2))
print("warm", flush=True)
sys.stdin.readline()
cpu = lambda: sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
c0 = cpu()
done = [(o.task_id, o.submitted_at, o.finished_at, o.ok) for o in run_requests([make(warm + i) for i in range(n)],
                                                                              concurrency=2)]
wall = max(d[2] for d in done) - min(d[1] for d in done)  # the first sent to the last seen done, as `replicadp bench`
print(json.dumps({"wall_s": wall, "cpu_s": cpu() - c0, "requests": done}), flush=True)
"""


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def replica_processes(launcher: int) -> tuple[int, int]:
    """(main process, pool child) of the one replica under worker_launch.sh's process `launcher`."""
    def celery(pid):
        return b"celery" in Path(f"/proc/{pid}/cmdline").read_bytes()
    todo, found = [launcher], []
    while todo:
        kids = children(todo.pop())
        found += [k for k in kids if celery(k)]
        todo += kids
    main = next(p for p in found if any(c in found for c in children(p)))
    return main, next(c for c in children(main) if c in found)


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_stats(client: redis.Redis) -> dict:
    info = client.info("all")
    return {"commands": info["total_commands_processed"], "round_trips": info["total_reads_processed"],
            "cpu_s": info["used_cpu_sys"] + info["used_cpu_user"],
            "by_command": {k.removeprefix("cmdstat_"): v["calls"] for k, v in info.items() if k.startswith("cmdstat_")}}


class Records(threading.Thread):
    """Every result record the replica writes (Celery publishes each one it stores), with when it was seen; and
    Celery's task events, each with its own time: sent (by the client, once the message is in Redis), received
    (by the replica's main process, once it has popped, checked and recorded it) and succeeded (once the main
    process has the result from its pool child)."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.pubsub = redis.Redis.from_url(url).pubsub()
        self.pubsub.psubscribe("celery-task-meta-*", "*celeryev/task*")
        self.seen: dict[str, list[tuple[float, dict]]] = {}
        self.events: dict[str, dict[str, float]] = {}  # task id -> event type -> its timestamp
        self.stop = threading.Event()

    def run(self):
        while not self.stop.is_set():
            message = self.pubsub.get_message(timeout=0.2)
            if not message or message["type"] != "pmessage":
                continue
            channel = message["channel"].decode()
            if channel.startswith("celery-task-meta-"):
                task_id = channel.removeprefix("celery-task-meta-")
                self.seen.setdefault(task_id, []).append((time.time(), json.loads(message["data"])))
                continue
            events = json.loads(base64.b64decode(json.loads(message["data"])["body"]))  # kombu's envelope
            for event in events if isinstance(events, list) else [events]:  # task.multi: a batch
                self.events.setdefault(event["uuid"], {})[event["type"]] = event["timestamp"]


def phases(sent: list, seen: dict, events: dict) -> dict[str, float]:
    """Median milliseconds of each part of a request, in order, from its records and events (a tree that writes
    no phases: the parts it can tell)."""
    parts: dict[str, list[float]] = {}
    for task_id, submitted, finished, _ in sent:
        records, told = seen.get(task_id, []), events.get(task_id, {})
        started = next((t for t, r in records if r["status"] == "STARTED"), None)
        succeeded = next((t for t, r in records if r["status"] == "SUCCESS"), None)
        if started is None or succeeded is None or {"task-sent", "task-received"} - set(told):
            continue
        begun = {}
        for _, r in records:
            if r["status"] == "PROGRESS" and "phase" in r["result"]:
                begun.setdefault(r["result"]["phase"], r["result"]["phase_started_at"])
        marks = [("producer send (the message, the sent event)", submitted),
                 ("queued behind the request ahead (2 in flight)", told["task-sent"]),
                 ("hand-over to the pool child (and its STARTED record)", told["task-received"])]
        if not begun:  # a tree whose replica writes no phases: the replica's time in one piece
            marks.append(("on the replica", started))
        else:
            marks.append(("inputs and fence", started))
            if "denoising" in begun:
                marks.append(("denoising", begun["denoising"]))
            marks += [(name, begun.get(phase)) for name, phase in (
                ("decoding (to the encode's start: with the finisher, its wait for the next request's compute)",
                 "decoding"), ("encoding", "encoding"), ("storing and result", "storing"))]
        marks += [("client wake-up", succeeded), ("end", finished)]
        marks = [(name, t) for name, t in marks if t is not None]
        for (name, t), (_, after) in zip(marks, marks[1:]):
            parts.setdefault(name, []).append(1000 * (after - t))
        if "task-succeeded" in told:  # beside the client's wake-up, not before it
            parts.setdefault("the result back to the main process", []).append(
                1000 * (told["task-succeeded"] - succeeded))
    return {name: round(statistics.median(ms), 2) for name, ms in parts.items() if ms}


def one_round(tree: Path, url: str, model: str, steps: int, requests: int, work: Path, profile: Path | None) -> dict:
    """One replica of `model` and one client, both of `tree`, on `url`: the figures of `requests` requests of
    `steps` steps."""
    client = redis.Redis.from_url(url)
    client.flushall()
    env = {**os.environ, "PYTHONPATH": str(tree), "REDIS_URL": url, "REPLICADP_MODEL": model,
           "NUM_REPLICAS": "1", "DEVICES": "cpu", "THREADS_PER_REPLICA": "1", "OUTPUT_DIR": str(work / "out"),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", "HF_HUB_OFFLINE": "1"}
    with ExitStack() as stack:
        log = stack.enter_context(open(work / "replica.log", "ab"))
        launcher = subprocess.Popen(["bash", str(tree / "worker_launch.sh"), "--loglevel", "WARNING"], env=env,
                                    cwd=tree, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    preexec_fn=die_with_parent)
        stack.callback(stop_group, launcher.pid, 60, launcher)
        cli = subprocess.Popen([sys.executable, "-c", CLIENT, str(steps), str(requests), str(WARM_UP),
                                json.dumps(SHAPE)], env=env, cwd=tree, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, preexec_fn=die_with_parent)
        stack.callback(cli.kill)
        if cli.stdout.readline().strip() != "warm":  # the warm-up waits for the replica to serve
            raise click.ClickException(f"the client of {tree} failed; see {work / 'replica.log'}")
        main, child = replica_processes(launcher.pid)
        records = Records(url)
        records.start()
        spies = []
        if profile is not None:
            for name, pid in (("main", main), ("child", child)):
                spies.append(subprocess.Popen(
                    [str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(pid), "--rate", "250",
                     "--nonblocking", "--output", str(profile / f"serving-cost-profile-{name}.svg")],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            time.sleep(1.0)  # py-spy attaches
        before, cpu_before = server_stats(client), (cpu_s(main), cpu_s(child))
        cli.stdin.write("go\n")
        cli.stdin.flush()
        out = json.loads(cli.stdout.readline())
        after, cpu_after = server_stats(client), (cpu_s(main), cpu_s(child))
        for spy in spies:
            spy.send_signal(2)
            spy.wait(timeout=60)
        time.sleep(0.3)  # the last records
        records.stop.set()
        records.join()
    n = len(out["requests"])
    return {"ms_per_request": 1000 * out["wall_s"] / n, "failed": sum(not ok for *_, ok in out["requests"]),
            "cpu_ms_per_request": {"client": 1000 * out["cpu_s"] / n,
                                   "replica main": 1000 * (cpu_after[0] - cpu_before[0]) / n,
                                   "replica child": 1000 * (cpu_after[1] - cpu_before[1]) / n,
                                   "redis": 1000 * (after["cpu_s"] - before["cpu_s"]) / n},
            "redis_commands_per_request": (after["commands"] - before["commands"]) / n,
            "redis_round_trips_per_request": (after["round_trips"] - before["round_trips"]) / n,
            "redis_commands_by_name": dict(sorted(  # the whole server's: the bench's INFO and subscriber too
                ((name, round((calls - before["by_command"].get(name, 0)) / n, 2))
                 for name, calls in after["by_command"].items() if calls > before["by_command"].get(name, 0)),
                key=lambda kv: -kv[1])),
            "phases_ms": phases(out["requests"], records.seen, records.events)}


def median_of(runs: list[dict], *path) -> float:
    def get(run):
        for key in path:
            run = run[key]
        return run
    return statistics.median(get(r) for r in runs)


@click.command()
@click.option("--requests", default=200, show_default=True, help="Timed requests per round.")
@click.option("--rounds", default=3, show_default=True)
@click.option("--steps", "many", default=30, show_default=True, help="The step count compared with 1 step.")
@click.option("--compute-ms", default=0.0, show_default=True,
              help="Each request's compute (off the CPU, after its steps); 0: nothing to compute.")
@click.option("--baseline", default=None, help="A git revision to measure in alternate rounds (before and after).")
@click.option("--profile", type=click.Path(path_type=Path), default=None,
              help="Write py-spy flame graphs of the replica's main process and pool child here.")
@click.option("--out", default="bench-results/serving-cost.json", show_default=True, type=click.Path(path_type=Path))
def main(requests, rounds, many, compute_ms, baseline, profile, out):
    console = Console(width=None if sys.stdout.isatty() else 150)
    work = Path(tempfile.mkdtemp(prefix="replicadp-serving-cost-"))
    trees = {"this tree": ROOT}
    model = f"synthetic:0:{compute_ms / 1000:g}" if compute_ms else "synthetic:0"
    results: dict = {}
    server = EmbeddedServer(work / "redis")
    try:
        if baseline:
            rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", baseline], capture_output=True,
                                 text=True, check=True).stdout.strip()
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(work / "baseline"), rev],
                           capture_output=True, check=True)
            trees = {f"baseline {rev}": work / "baseline", **trees}
        url = server.start()
        if profile is not None:
            profile.mkdir(parents=True, exist_ok=True)
        for steps in (1, many):
            for round_ in range(rounds):
                for name, tree in trees.items():
                    spy = profile if profile is not None and tree == ROOT and steps == 1 and round_ == 0 else None
                    got = one_round(tree, url, model, steps, requests, work, spy)
                    results.setdefault(name, {}).setdefault(str(steps), []).append(got)
                    console.print(f"{name}, {steps} step(s), round {round_ + 1}: {got['ms_per_request']:.1f} ms a "
                                  f"request, {got['redis_round_trips_per_request']:.1f} round trips")
    finally:
        server.stop()
        if baseline:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(work / "baseline")],
                           capture_output=True)
        shutil.rmtree(work, ignore_errors=True)

    table = Table(title=f"serving cost, {model} 128x128x33, 1 replica, 2 in flight, {requests} requests x "
                        f"{rounds} rounds (medians)")
    for col in ("tree", "ms / request at 1 step", f"at {many}", f"beyond the {compute_ms:g} ms of compute: at 1 step",
                f"at {many}", "ms / extra step", "CPU ms / request (client, main, "
                "child, redis)", "Redis commands / request", "round trips / request", "round trips / step"):
        table.add_column(col, justify="right")
    summary = {}
    for name, by in results.items():
        one, more = by["1"], by[str(many)]
        ms1, msn = median_of(one, "ms_per_request"), median_of(more, "ms_per_request")
        trips1 = median_of(one, "redis_round_trips_per_request")
        tripsn = median_of(more, "redis_round_trips_per_request")
        cpu = {k: median_of(one, "cpu_ms_per_request", k) for k in one[0]["cpu_ms_per_request"]}
        got = summary[name] = {
            "ms_per_request_1_step": ms1, f"ms_per_request_{many}_steps": msn,
            "serving_ms_per_request_1_step": ms1 - compute_ms, f"serving_ms_per_request_{many}_steps": msn - compute_ms,
            "ms_per_extra_step": (msn - ms1) / (many - 1), "cpu_ms_per_request_1_step": cpu,
            "redis_commands_per_request_1_step": median_of(one, "redis_commands_per_request"),
            "redis_round_trips_per_request_1_step": trips1,
            "redis_round_trips_per_extra_step": (tripsn - trips1) / (many - 1),
            "phases_ms_1_step": one[0]["phases_ms"], f"phases_ms_{many}_steps": more[0]["phases_ms"], "rounds": by}
        table.add_row(name, f"{ms1:.1f}", f"{msn:.1f}", f"{got['serving_ms_per_request_1_step']:.1f}",
                      f"{got[f'serving_ms_per_request_{many}_steps']:.1f}", f"{got['ms_per_extra_step']:.2f}",
                      ", ".join(f"{v:.1f}" for v in cpu.values()), f"{got['redis_commands_per_request_1_step']:.0f}",
                      f"{trips1:.1f}", f"{got['redis_round_trips_per_extra_step']:.2f}")
    console.print(table)
    parts = Table(title="where one request's time goes, ms (medians over the requests of the first round)")
    parts.add_column("part")
    names = []
    for name, got in summary.items():
        for col in ("1 step", f"{many} steps"):
            parts.add_column(f"{name}, {col}", justify="right")
        names += [p for p in got[f"phases_ms_{many}_steps"] if p not in names]
    for part in names:
        parts.add_row(part, *[str(got[key].get(part, "-")) for got in summary.values()
                              for key in ("phases_ms_1_step", f"phases_ms_{many}_steps")])
    console.print(parts)
    by_name = Table(title="Redis commands per request at 1 step, by name (the first round; MULTI/EXEC counted)")
    by_name.add_column("command")
    for name in summary:
        by_name.add_column(name, justify="right")
    counts = {name: got["rounds"]["1"][0]["redis_commands_by_name"] for name, got in summary.items()}
    for command in sorted({c for got in counts.values() for c in got}, key=lambda c: -max(
            got.get(c, 0) for got in counts.values())):
        if max(got.get(command, 0) for got in counts.values()) >= 0.5:
            by_name.add_row(command, *[f"{got.get(command, 0):.1f}" for got in counts.values()])
    console.print(by_name)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"measured_at": datetime.now().isoformat(timespec="seconds"), "requests": requests,
                               "rounds": rounds, "shape": SHAPE, "model": model, "compute_ms": compute_ms,
                               "results": summary}, indent=1))
    console.print(f"JSON: {out}")


if __name__ == "__main__":
    main()
