"""The replicas of this host and what they do: `up` (the embedded server and N replicas, in the background), `down`
(stop them) and `status` (live replicas, their requests, the queue)."""

from __future__ import annotations

import json
import time

import click

from ..api import check_redis
from ..progress import console
from .group import main
from .options import redis_url_option


@main.command()
@click.option("--replicas", "n", type=int, help="Replicas to start (default: one per --gpus-per-replica GPUs, or 1 on "
                                                 "the CPU).")
@click.option("--devices", default="auto", show_default=True,
              help="GPU ids (0,1,...), cpu, or auto: the visible GPUs (CUDA_VISIBLE_DEVICES, else nvidia-smi's), "
                   "else cpu.")
@click.option("--gpus-per-replica", type=int, help="Default: REPLICADP_PARALLEL's rank count (one GPU per rank), "
              "else 1.")
@click.option("--threads", type=int, help="CPU threads per replica (cpu only).")
# tiny unless REPLICADP_MODEL says otherwise: `up` works offline out of the box.
@click.option("--model", default="tiny", envvar="REPLICADP_MODEL", show_default=True, show_envvar=True,
              help="Model spec: tiny, a local folder or a hub id.")
@click.option("--timeout", default=900.0, show_default=True, help="Seconds to wait for the replicas to load.")
@click.option("--ha", is_flag=True, help="Start a Redis that fails over instead of one server: a primary, two "
              "replicas and three Sentinels (docs/operations.md).")
@redis_url_option(help="Redis to start the replicas on (default: an embedded server, started here).")
def up(n, devices, gpus_per_replica, threads, model, timeout, ha):
    """Start the embedded server (unless REDIS_URL is set) and N replicas in the background."""
    from replicadp_tasks.settings import SETTINGS

    from ..api import redacted
    from ..local.replicas import plan, up as do_up, visible_gpus

    gpus_per_replica = gpus_per_replica or SETTINGS.parallel.size
    try:
        chosen, n = plan(devices, n, gpus_per_replica, visible_gpus() if devices == "auto" else [])
    except ValueError as exc:
        raise click.UsageError(str(exc))
    layout = f", each over {SETTINGS.parallel.size} ranks ({SETTINGS.parallel})" if SETTINGS.parallel.size > 1 else ""
    console.print(f"up: {n} replica(s) of {model!r} on {'the CPU' if chosen == 'cpu' else 'GPU(s) ' + chosen}"
                  + (" (--devices auto)" if devices == "auto" else "") + layout)
    try:
        state = do_up(n, model, chosen, threads, gpus_per_replica, timeout, ha=ha)
    except (RuntimeError, TimeoutError) as exc:
        raise click.ClickException(str(exc))
    console.print(f"up: {len(state['replicas'])} replica(s) serving {model!r} on {redacted(state['redis_url'])}; "
                  f"logs in {state['run_dir']}; stop with `replicadp down`")


@main.command()
def down():
    """Stop what `replicadp up` started."""
    from ..local.replicas import down as do_down

    state = do_down()
    console.print("nothing is up" if state is None else f"stopped {len(state['replicas'])} replica(s)")


@main.command()
@click.option("--watch", is_flag=True, help="Refresh every second until Ctrl-C.")
@click.option("--json", "json_out", is_flag=True, help="Print the snapshot as JSON on stdout, once.")
@redis_url_option()
def status(watch, json_out):
    """Live replicas (each one's fast path: the step cache of quality=fast), the request each is running and its
    step, queue depth, recent throughput."""
    from rich.live import Live

    from ..ops.status import snapshot, table

    if watch and json_out:
        raise click.UsageError("--watch and --json are exclusive: --json prints one snapshot")
    check_redis()
    if json_out:
        click.echo(json.dumps(snapshot(), indent=1))
        return
    if not watch:
        console.print(table(snapshot()))
        return
    with Live(table(snapshot()), console=console, refresh_per_second=2) as live:
        try:
            while True:
                time.sleep(1.0)
                live.update(table(snapshot()))
        except KeyboardInterrupt:
            pass
