"""What a long run shows while it runs, for the bench, the demo, the sweep and `replicadp submit`: the console, a
progress bar of requests with the denoising step of those in flight, and the wait for a first live replica."""

from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from replicadp_tasks.contract import Phase

from .api import ClientError, InFlight, live_replicas

# Piped output (logs, CI, tests) is not wrapped at 80 columns.
console = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 160)


def progress_bar() -> Progress:
    """Requests done out of the total, time elapsed, and `flight` (flight_text) after them."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("{task.fields[flight]}"), console=console, transient=True)


def phase_text(f: InFlight) -> str:
    """Where a request in flight is: `step/steps` while it denoises, else its phase (decoding, ...) or state."""
    if f.phase in (None, Phase.DENOISING) and f.total_steps:
        return f"{f.step}/{f.total_steps}"
    return (f.phase or f.state).lower().replace("_", " ")


def flight_text(in_flight: list[InFlight]) -> str:
    """`[replica step/steps]`, or `[replica decoding]` past its last step, for up to four running requests."""
    running = [f for f in in_flight if f.total_steps]
    return " ".join(f"[{f.replica or '?'} {phase_text(f)}]" for f in running[:4])


def wait_for_replicas(timeout: float, model: str | None = None) -> list[str]:
    """The live replicas (`model`: of that model), waiting up to `timeout` seconds for the first one; ClientError
    if none comes."""
    live = live_replicas(model=model)
    of = "" if model is None else f" of {model!r}"
    if not live:
        console.print(f"[yellow]no live replica{of} yet; waiting up to {timeout:.0f} s (start some with "
                      "worker_launch.sh or `replicadp up`)[/yellow]")
        deadline = time.monotonic() + timeout
        while not live and time.monotonic() < deadline:
            time.sleep(1.0)
            live = live_replicas(model=model)
        if not live:
            raise ClientError(f"no live replica{of} after {timeout:.0f} s")
    return live
