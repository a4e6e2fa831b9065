"""How long `replicadp` commands take against one running replica: `--help` (the import floor every command pays),
`status` (start to exit), and `submit` (start to its first request reaching Redis, seen through MONITOR).

One embedded server and one replica of the synthetic backend in a temporary folder, started once; each command
runs `--runs` times as a fresh process, and the table gives the median and the range. `--tree DIR` runs the
commands from another checkout (`python -m client` there; the replica stays this checkout's), to compare two
versions against the same replica:

    .venv/bin/python bench/cli_latency.py --runs 5
    git worktree add /tmp/before HEAD~1 && .venv/bin/python bench/cli_latency.py --runs 5 --tree /tmp/before
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import click
import redis
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from client.local.embedded import EmbeddedServer  # noqa: E402
from client.local.replicas import Replicas  # noqa: E402


def first_request_s(url: str, command: list[str], cwd: Path, env: dict, batch: Path) -> float:
    """Seconds from starting `command` (a submit of `batch`) to the first request it sends reaching Redis."""
    seen, ready = [], threading.Event()

    def watch():
        with redis.Redis.from_url(url).monitor() as monitor:
            ready.set()
            for entry in monitor.listen():
                if "replicadp.generate" in entry["command"]:  # the message, placed on the queue
                    seen.append(entry["time"])
                    return

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    ready.wait()
    started = time.time()  # the server runs on this host: MONITOR's times are on this clock
    subprocess.run([*command, str(batch)], cwd=cwd, env=env, capture_output=True, check=True, timeout=120)
    watcher.join(timeout=10)
    return seen[0] - started


def wall_s(command: list[str], cwd: Path, env: dict) -> float:
    started = time.perf_counter()
    subprocess.run(command, cwd=cwd, env=env, capture_output=True, check=True, timeout=120)
    return time.perf_counter() - started


@click.command()
@click.option("--runs", default=5, show_default=True, help="Fresh processes per command.")
@click.option("--tree", type=click.Path(file_okay=False, path_type=Path), default=ROOT, show_default=True,
              help="The checkout whose commands run.")
def main(runs: int, tree: Path):
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="cli-latency-") as tmp:
        folder = Path(tmp)
        server = EmbeddedServer(folder / "redis")
        url = server.start()
        stack.callback(server.stop)
        own = {"OUTPUT_DIR": str(folder / "out"), "REPLICADP_STATE_DIR": str(folder / "state")}
        replicas = Replicas(1, redis_url=url, model="synthetic:1", threads=1, env=own, log_path=folder / "replica.log")
        env = {**os.environ, **own, "REDIS_URL": url, "PYTHONPATH": str(tree)}
        stack.enter_context(replicas)
        cli = [sys.executable, "-m", "client"]
        samples: dict[str, list[float]] = {"--help": [], "status": [], "submit: first request": []}
        for i in range(runs):
            samples["--help"].append(wall_s([*cli, "--help"], tree, env))
            samples["status"].append(wall_s([*cli, "status"], tree, env))
            batch = folder / f"batch{i}.jsonl"
            batch.write_text(json.dumps({"prompt": f"latency {i}", "height": 64, "width": 64, "num_frames": 5,
                                         "num_inference_steps": 1}) + "\n")
            samples["submit: first request"].append(first_request_s(url, [*cli, "submit"], tree, env, batch))
    table = Table(title=f"replicadp commands from {tree}, {runs} runs each, one replica")
    for column in ("command", "median s", "min s", "max s"):
        table.add_column(column)
    for name, values in samples.items():
        table.add_row(name, f"{statistics.median(values):.2f}", f"{min(values):.2f}", f"{max(values):.2f}")
    Console().print(table)


if __name__ == "__main__":
    main()
