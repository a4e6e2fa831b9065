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
@click.option("--model", "models", multiple=True, envvar="REPLICADP_MODEL", show_envvar=True, metavar="SPEC",
              help="Model spec: tiny, a local folder or a hub id (default: tiny, which works offline). Repeat for a "
                   "fleet: each --replicas, --devices, --served-model-name, --loras and --recipe goes with the "
                   "--model in its place, or one value with every model.")
@click.option("--served-model-name", "served_names", multiple=True, metavar="NAME",
              help="The name requests give for the model (default: its spec).")
@click.option("--replicas", "counts", type=int, multiple=True, help="Replicas to start (default: one per "
              "--gpus-per-replica GPUs, or 1 on the CPU).")
@click.option("--devices", "devices", multiple=True, help="GPU ids (0,1,...), cpu, or auto: the visible GPUs "
              "(CUDA_VISIBLE_DEVICES, else nvidia-smi's) that the models before it left, else cpu.  [default: auto]")
@click.option("--gpus-per-replica", type=int, help="Default: REPLICADP_PARALLEL's rank count (one GPU per rank), "
              "else 1.")
@click.option("--loras", multiple=True, metavar="FILE|none", help="The model's adapter registry (REPLICADP_LORAS): "
              "with adapters fused at load, a few-step variant of the model (default: REPLICADP_LORAS).")
@click.option("--recipe", "recipes", multiple=True, metavar="TABLE|none", help="The model's sampling recipe "
              "(REPLICADP_RECIPE), e.g. '{num_inference_steps = 4, guidance_scale = 1.0}' for a distilled checkpoint "
              "(default: REPLICADP_RECIPE).")
@click.option("--threads", type=int, help="CPU threads per replica (cpu only).")
@click.option("--timeout", default=900.0, show_default=True, help="Seconds to wait for the replicas to load.")
@click.option("--ha", is_flag=True, help="Start a Redis that fails over instead of one server: a primary, two "
              "replicas and three Sentinels (docs/operations.md).")
@redis_url_option(help="Redis to start the replicas on (default: an embedded server, started here).")
def up(models, served_names, counts, devices, gpus_per_replica, loras, recipes, threads, timeout, ha):
    """Start the embedded server (unless REDIS_URL is set) and the replicas of one model or several, in the
    background."""
    from replicadp_tasks.settings import SETTINGS

    from ..api import redacted
    from ..local.replicas import fleet_plan, up as do_up, visible_gpus

    gpus_per_replica = gpus_per_replica or SETTINGS.parallel.size
    try:
        groups = fleet_plan(models or ("tiny",), served_names, counts, devices, gpus_per_replica,
                            visible_gpus() if "auto" in (devices or ("auto",)) else [], loras, recipes)
    except ValueError as exc:
        raise click.UsageError(str(exc))
    layout = f", each over {SETTINGS.parallel.size} ranks ({SETTINGS.parallel})" if SETTINGS.parallel.size > 1 else ""
    for g in groups:
        name = f" as {g.served_name!r}" if g.served_name else ""
        console.print(f"up: {g.n} replica(s) of {g.model!r}{name} on "
                      f"{'the CPU' if g.devices == 'cpu' else 'GPU(s) ' + g.devices}"
                      + (" (--devices auto)" if g.auto else "") + layout)
    try:
        state = do_up(groups, threads, gpus_per_replica, timeout, ha=ha)
    except (RuntimeError, TimeoutError) as exc:
        raise click.ClickException(str(exc))
    console.print(f"up: {len(state['replicas'])} replica(s) serving {', '.join(map(repr, state['models']))} on "
                  f"{redacted(state['redis_url'])}; logs in {state['run_dir']}; stop with `replicadp down`")


@main.command("forget-model")
@click.argument("name")
@redis_url_option()
def forget_model(name):
    """Take back the declaration of model NAME (cluster/fleet.py): requests for it are refused from then on.
    Refused while a replica of it is live or requests wait in its queue (exit 1)."""
    from replicadp_tasks.cluster import connection, fleet

    from ..api import live_replicas, redis_url
    from ..ops.status import queue_head

    check_redis()
    client = connection.client(redis_url())
    if name not in fleet.declared(client):
        raise click.ClickException(f"model {name!r} is not declared on this Redis")
    live, waiting = live_replicas(model=name), sum(queue_head(client, name)[0].values())
    if live or waiting:
        raise click.ClickException(f"model {name!r} is still served: {len(live)} live replica(s), {waiting} "
                                   "request(s) waiting; stop its replicas and let its queue drain (or cancel)")
    fleet.forget(client, name)
    console.print(f"forgot model {name!r}: requests for it are refused now")


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
    """Each model the deployment serves (its replicas, queue depth, how long the next request waited, videos/min),
    and the live replicas (each one's model and fast path: the step cache of quality=fast), the request each is
    running and its step."""
    from rich.console import Group
    from rich.live import Live

    from ..ops.status import models_table, snapshot, table

    def tables():
        snap = snapshot()
        return Group(models_table(snap), table(snap))

    if watch and json_out:
        raise click.UsageError("--watch and --json are exclusive: --json prints one snapshot")
    check_redis()
    if json_out:
        click.echo(json.dumps(snapshot(), indent=1))
        return
    if not watch:
        console.print(tables())
        return
    with Live(tables(), console=console, refresh_per_second=2) as live:
        try:
            while True:
                time.sleep(1.0)
                live.update(tables())
        except KeyboardInterrupt:
            pass
