"""Figure 8: scheduling (priorities, round robin across users, longest-first batches) against one FIFO list, on
synthetic replicas.

    .venv/bin/python bench/scheduling.py --out bench-results/scheduling.json

Four measurements; each producer runs in a process of its own, under REPLICADP_SCHEDULING=fair (the default)
or fifo (one list in arrival order), since a producer reads its setting once at start-up:
  mixed       12 requests of 17/49/81 frames, the 81-frame ones last (the adversarial order), on 2 and 4
              replicas: makespan / max(total / N, longest), in file order and in the order plain `submit` sends
              (longest first), next to a round-robin router's on the same orders (from the measured durations);
  interactive 20 interactive requests, one every --gap seconds, each arriving behind a backlog of 200 batch
              requests (topped up before each arrival) on 2 replicas: wait before starting, p50 / p99;
  users       user A queues 200 requests, then user B sends 10: when B's tenth completes, after B's first send;
  throughput  120 requests of three priorities and four users, all queued at once: videos/min.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from client.local.embedded import EmbeddedServer  # noqa: E402
from client.local.replicas import Replicas  # noqa: E402
from replicadp_tasks.cluster import connection  # noqa: E402
from replicadp_tasks.contract import REFERENCE_WORK  # noqa: E402

# Every request but the mixed ones: 64x64, 5 frames (encoding takes milliseconds), STEPS steps of the synthetic
# backend, sized to --duration by the model's SECONDS.
SHAPE = {"height": 64, "width": 64, "num_frames": 5}
STEPS = 4
MIXED_FRAMES = [17] * 5 + [49] * 4 + [81] * 3  # 81-frame requests last
MIXED_SIZE = {"height": 256, "width": 256, "num_inference_steps": 30}
BACKLOG, ARRIVALS = 200, 20
USER_A, USER_B = 200, 10
MIXED_TOTAL = 120


def short(prompt: str, **fields) -> dict:
    return {"prompt": prompt, **SHAPE, "num_inference_steps": STEPS, **fields}


def queue() -> str:
    """The queue of the model the replicas up now serve (one at a time here: the deployment's default)."""
    from client.api import model_for
    from replicadp_tasks.contract import queue_for
    from replicadp_tasks.settings import SETTINGS

    return queue_for(SETTINGS.queue, model_for(None))


def purge() -> None:
    """Drop what still waits (the backlog no one measures) and let the replicas finish what they run."""
    from replicadp_tasks.contract import queue_lists
    from replicadp_tasks.settings import SETTINGS

    client = connection.client(SETTINGS.redis_url)
    client.delete(*queue_lists(queue()))
    time.sleep(2.0)


def warm(n: int) -> None:
    """First requests on a replica pay one-off costs (ffmpeg start-up, imports)."""
    from client.api import run_requests

    assert all(o.ok for o in run_requests([short(f"warm {i}") for i in range(2 * n)], timeout=120))


# --- the measurements, each run as a producer process of its own (`--phase`) ---------------------------------------

def phase_mixed(n: int) -> dict:
    from mixed_sizes import measure

    from client.submit import longest_first

    warm(n)
    drawn = [{"prompt": f"mixed {i}", "seed": i, **MIXED_SIZE, "num_frames": f} for i, f in enumerate(MIXED_FRAMES)]
    # measure() also gives a round-robin router's makespan on the same order (request i on replica i mod N).
    return {order: measure(reqs, n) for order, reqs in (("file order", drawn),
                                                         ("submit (longest first)", longest_first(drawn)))}


def phase_interactive(n: int, gap: float) -> dict:
    from replicadp_tasks import generate
    from replicadp_tasks.broker import next_request
    from replicadp_tasks.settings import SETTINGS

    warm(n)
    client = connection.client(SETTINGS.redis_url)
    sent = 0
    arrivals = []
    began = time.time()
    for i in range(ARRIVALS):
        waiting, _ = next_request(client, queue())  # under fifo, all in one list
        for _ in range(BACKLOG - sum(waiting.values())):
            generate.apply_async(kwargs=short(f"backlog {sent}", priority="batch"))
            sent += 1
        arrivals.append(generate.apply_async(kwargs=short(f"interactive {i}", priority="interactive")))
        time.sleep(gap)
    waits = [r.get(timeout=600)["timings"]["queued_s"] for r in arrivals]
    # One request's duration as the replicas lived it: in-task time plus dispatch, encoding, storing, acking.
    served = sent + ARRIVALS - sum(next_request(client, queue())[0].values()) - n
    service_s = n * (time.time() - began) / served
    purge()
    return {"waits_s": waits, "service_s": service_s}


def phase_users(n: int) -> dict:
    from client.api import run_requests
    from replicadp_tasks import generate

    warm(n)
    for i in range(USER_A):
        generate.apply_async(kwargs=short(f"a {i}", user="a"))
    outcomes = list(run_requests([short(f"b {i}", user="b") for i in range(USER_B)], timeout=600))
    assert all(o.ok for o in outcomes), [o.error for o in outcomes if not o.ok]
    purge()
    return {"b_tenth_s": max(o.finished_at for o in outcomes) - min(o.submitted_at for o in outcomes)}


def phase_throughput(n: int) -> dict:
    from client.api import run_requests

    warm(n)
    priorities, users = ("interactive", "normal", "batch"), ("a", "b", "c", None)
    reqs = [short(f"t {i}", priority=priorities[i % 3], user=users[i % 4]) for i in range(MIXED_TOTAL)]
    outcomes = list(run_requests(reqs, timeout=600))
    assert all(o.ok for o in outcomes), [o.error for o in outcomes if not o.ok]
    makespan = max(o.finished_at for o in outcomes) - min(o.submitted_at for o in outcomes)
    return {"videos_per_min": 60 * MIXED_TOTAL / makespan, "makespan_s": makespan}


PHASES = {"mixed": phase_mixed, "interactive": phase_interactive, "users": phase_users,
          "throughput": phase_throughput}


def run_phase(name: str, mode: str, url: str, n: int, **args) -> dict:
    """One measurement in a producer process of its own, under REPLICADP_SCHEDULING=`mode`."""
    env = {**os.environ, "REDIS_URL": url, "REPLICADP_SCHEDULING": mode}
    out = subprocess.run([sys.executable, __file__, "--phase", name, "--phase-args", json.dumps({"n": n, **args})],
                         env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise SystemExit(f"phase {name} ({mode}) failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


@click.command()
@click.option("--duration", default=0.2, show_default=True, help="Seconds per request (all but the mixed ones).")
@click.option("--mixed-seconds", default=20.0, show_default=True,
              help="synthetic:SECONDS for the mixed batch: an 81-frame 256x256x30 request takes 0.4 x SECONDS.")
@click.option("--gap", default=0.5, show_default=True, help="Seconds between interactive arrivals.")
@click.option("--repeats", default=2, show_default=True, help="Throughput runs per mode (alternating).")
@click.option("--out", default="bench-results/scheduling.json", show_default=True,
              help="The report as JSON: a file, or - for standard output.")
@click.option("--figures", default="mixed,interactive,users,throughput", show_default=True,
              help="Which measurements to run.")
@click.option("--phase", hidden=True)
@click.option("--phase-args", hidden=True)
def main(duration, mixed_seconds, gap, repeats, out, figures, phase, phase_args):
    if phase:  # a producer process of run_phase: its result as the last line of stdout
        print(json.dumps(PHASES[phase](**json.loads(phase_args))))
        return
    console = Console(stderr=out == "-", soft_wrap=True, width=None if sys.stdout.isatty() else 160)
    seconds = duration * REFERENCE_WORK / (SHAPE["height"] * SHAPE["width"] * SHAPE["num_frames"] * STEPS)
    report = {"duration_s": duration, "mixed_seconds": mixed_seconds, "gap_s": gap, "mixed": {},
              "interactive": {}, "users": {}, "throughput": {"fifo": [], "fair": []}}
    run_dir = Path(tempfile.mkdtemp(prefix="replicadp-scheduling-"))
    try:
        server = EmbeddedServer(run_dir / "redis")
        url = server.start()
        env = {"OUTPUT_DIR": str(run_dir / "outputs")}
        try:
            for n in (2, 4) if "mixed" in figures else ():
                with Replicas(n, redis_url=url, model=f"synthetic:{mixed_seconds}", env=env,
                              log_path=run_dir / f"mixed-{n}.log"):
                    report["mixed"][n] = run_phase("mixed", "fair", url, n)
                    console.print(f"mixed N={n}: done")
            with Replicas(2, redis_url=url, model=f"synthetic:{seconds}", env=env, log_path=run_dir / "short.log"):
                for mode in ("fifo", "fair"):
                    if "interactive" in figures:
                        report["interactive"][mode] = run_phase("interactive", mode, url, 2, gap=gap)
                    if "users" in figures:
                        report["users"][mode] = run_phase("users", mode, url, 2)
                    console.print(f"interactive, users ({mode}): done")
                for _ in range(repeats if "throughput" in figures else 0):
                    for mode in ("fifo", "fair"):
                        report["throughput"][mode].append(run_phase("throughput", mode, url, 2))
        finally:
            server.stop()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    print_report(console, report)
    text = json.dumps(report, indent=1)
    if out == "-":
        print(text)
    else:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)


def print_report(console: Console, r: dict) -> None:
    if r["mixed"]:
        t = Table(title=f"mixed batch: 12 requests, 5 of 17, 4 of 49 and 3 of 81 frames in that order; "
                        f"synthetic:{r['mixed_seconds']:g} at 256x256x30 steps; round-robin computed from the "
                        "measured durations")
        for col in ("replicas", "order", "makespan", "bound", "pull / bound", "round-robin / bound"):
            t.add_column(col, justify="right")
        for n, rows in r["mixed"].items():
            for order, m in rows.items():
                t.add_row(str(n), order, f"{m['makespan_s']:.2f} s", f"{m['bound_s']:.2f} s",
                          f"{m['vs_bound']:.3f}", f"{m['round_robin_vs_bound']:.3f}")
        console.print(t)
    d = r["duration_s"]
    t = Table(title=f"2 replicas, {d:g} s requests: interactive arrivals behind {BACKLOG} batch requests; user B's "
                    f"{USER_B} behind user A's {USER_A}; {MIXED_TOTAL} requests of mixed priorities and users")
    for col in ("scheduling", "interactive wait p50", "p99", "one request's duration", "p99 / duration",
                f"B's {USER_B}th done", f"/ ({USER_B} x {d:g} s / 2)", "videos/min, each run"):
        t.add_column(col, justify="right")
    for mode in ("fifo", "fair"):
        cells = ["-"] * 7
        if mode in r["interactive"]:
            waits, service = r["interactive"][mode]["waits_s"], r["interactive"][mode]["service_s"]
            p50, p99 = statistics.median(waits), percentile(waits, 99)
            cells[:4] = f"{p50:.2f} s", f"{p99:.2f} s", f"{service:.3f} s", f"{p99 / service:.2f}"
        if mode in r["users"]:
            b = r["users"][mode]["b_tenth_s"]
            cells[4:6] = f"{b:.2f} s", f"{b / (USER_B * d / 2):.2f}"
        cells[6] = ", ".join(f"{x['videos_per_min']:.1f}" for x in r["throughput"][mode]) or "-"
        t.add_row(mode, *cells)
    console.print(t)


if __name__ == "__main__":
    main()
