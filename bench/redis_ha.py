"""What a Redis that fails over costs a request: the serving cost (synthetic:0, nothing to compute) on one
embedded server against the HA stack (a primary, two replicas, three Sentinels: client/local/ha.py), where the
writes a guarantee rests on wait for a replica (WAIT, replication.durable). Rounds alternate between the two to
cancel drift; each is one `replicadp sweep` process. Also counts the WAITs and all commands per request on the
primary. Prints a table and writes JSON.

    .venv/bin/python bench/redis_ha.py --requests 100 --rounds 3 --out bench-results/redis-ha.json
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import click
import redis
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from client.local.embedded import EmbeddedServer  # noqa: E402
from client.local.ha import HAStack  # noqa: E402

REPLICADP = str(Path(sys.executable).parent / "replicadp")


def commands(client: redis.Redis) -> dict[str, int]:
    """Calls per command on this server so far (INFO commandstats)."""
    return {name.removeprefix("cmdstat_"): stats["calls"] for name, stats in client.info("commandstats").items()}


def one_round(url: str, primary: redis.Redis, steps: int, requests: int, out: Path) -> dict:
    """One `replicadp sweep` of one replica on `url`: ms per request, and WAITs and commands per request."""
    before = commands(primary)
    run = subprocess.run([REPLICADP, "sweep", "--replicas", "1", "--model", "synthetic:0", "--size", "128x128",
                          "--num-frames", "17", "--steps", str(steps), "--num-requests", str(requests),
                          "--concurrency", "2", "--out", str(out)], env={**os.environ, "REDIS_URL": url},
                         capture_output=True, text=True, timeout=1800)
    if run.returncode != 0:
        raise click.ClickException(f"sweep failed:\n{run.stdout}\n{run.stderr}")
    after = commands(primary)
    report = json.loads(out.with_suffix(".json").read_text())[0]
    sent = requests + report["config"]["warmup"]  # the warm-up requests go through Redis too
    return {"ms_per_request": 60_000 / report["videos_per_min"],
            "waits_per_request": (after.get("wait", 0) - before.get("wait", 0)) / sent,
            "commands_per_request": (sum(after.values()) - sum(before.values())) / sent}


@click.command()
@click.option("--requests", default=100, show_default=True)
@click.option("--rounds", default=3, show_default=True)
@click.option("--steps", "step_counts", default="1,30", show_default=True)
@click.option("--out", default="bench-results/redis-ha.json", show_default=True, type=click.Path(path_type=Path))
def main(requests, rounds, step_counts, out):
    console = Console(width=None if sys.stdout.isatty() else 140)
    run_dir = Path(tempfile.mkdtemp(prefix="replicadp-redis-ha-"))
    single, ha = EmbeddedServer(run_dir / "single"), HAStack(run_dir / "ha")
    results: dict = {}
    try:
        targets = {"one server": single.start(), "HA stack": ha.start()}
        for steps in [int(s) for s in step_counts.split(",")]:
            for round_ in range(rounds):
                for name, url in targets.items():
                    server = single if name == "one server" else ha.primary()
                    primary = redis.Redis(port=server.port, password=server.password)
                    got = one_round(url, primary, steps, requests, run_dir / f"{name}-{steps}-{round_}")
                    results.setdefault(f"{steps}", {}).setdefault(name, []).append(got)
                    console.print(f"{steps} step(s), round {round_ + 1}, {name}: {got['ms_per_request']:.1f} ms a "
                                  f"request, {got['waits_per_request']:.2f} WAIT, "
                                  f"{got['commands_per_request']:.0f} commands")
    finally:
        ha.stop()
        single.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
    table = Table(title=f"serving cost per request, synthetic:0, 1 replica, {requests} requests x {rounds} rounds "
                        "(median)")
    for col in ("steps", "one server", "HA stack", "added", "WAITs / request", "commands / request (one / HA)"):
        table.add_column(col, justify="right")
    summary = {}
    for steps, by in results.items():
        med = {name: statistics.median(r["ms_per_request"] for r in runs) for name, runs in by.items()}
        waits = statistics.median(r["waits_per_request"] for r in by["HA stack"])
        cmds = [statistics.median(r["commands_per_request"] for r in by[n]) for n in ("one server", "HA stack")]
        summary[steps] = {"ms_one_server": med["one server"], "ms_ha": med["HA stack"],
                          "added_ms": med["HA stack"] - med["one server"], "waits_per_request": waits,
                          "commands_per_request": cmds, "rounds": by}
        table.add_row(steps, f"{med['one server']:.1f} ms", f"{med['HA stack']:.1f} ms",
                      f"{med['HA stack'] - med['one server']:+.1f} ms", f"{waits:.2f}", f"{cmds[0]:.0f} / {cmds[1]:.0f}")
    console.print(table)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1))
    console.print(f"JSON: {out}")


if __name__ == "__main__":
    main()
