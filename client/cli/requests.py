"""One request at a time, and batches of them: `generate` (one video, with a progress bar), `get` and `cancel` (a
request by its ID), `submit` (a JSONL or text file of requests) and `webhook-secret` (a tenant's signing secret)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from replicadp_tasks.contract import DEFAULTS, REFERENCE_SIZE, InvalidRequest, Priority, Quality

from ..progress import console
from .group import main
from .options import (OPTION_OF, Exit, chosen_model, image_param, lora_param, model_option, redis_url_option,
                      size_param, user_param)


@main.command()
@click.argument("prompt")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the MP4 here (default: it stays in the output store; the summary says where).")
@click.option("--size", default=REFERENCE_SIZE, show_default=True, callback=size_param, help="WIDTHxHEIGHT.")
@click.option("--num-frames", default=DEFAULTS["num_frames"], show_default=True)
@click.option("--steps", type=int, help=f"Denoising steps (default: the model's: {DEFAULTS['num_inference_steps']}, "
              "or a few-step model's or adapter's recipe's).")
@click.option("--seed", default=DEFAULTS["seed"], show_default=True)
@click.option("--negative-prompt", default=DEFAULTS["negative_prompt"])
@click.option("--guidance", type=float, help="Guidance scale (default: the model's: 5.0, Wan2.2 T2V-A14B 4.0, "
              "I2V-A14B 3.5).")
@click.option("--guidance-2", "guidance_2", type=float,
              help="Two-expert models (Wan2.2 A14B): the low-noise expert's guidance scale (default: the model's: "
              "3.0 for T2V, 3.5 for I2V).")
@click.option("--boundary", type=float, help="Two-expert models: where the experts switch, 0 to 1 of the timesteps "
              "(default: the model's boundary_ratio).")
@click.option("--fps", default=DEFAULTS["fps"], show_default=True)
@click.option("--image", callback=image_param, metavar="FILE|URL", help="First frame (image-to-video models).")
@click.option("--priority", type=click.Choice([p.value for p in Priority]), help="Default: normal.")
@click.option("--user", callback=user_param, help="Who the request is for (round robin across users).")
@click.option("--quality", type=click.Choice([q.value for q in Quality]), help="Default: standard (the exact path); "
              "fast: the deployment's step cache, where it has one.")
@click.option("--lora", "loras", multiple=True, callback=lora_param, metavar="NAME[:SCALE]",
              help="A registered LoRA adapter to run with, and its scale (default: the adapter's); repeat for more.")
@model_option()
@click.option("--timeout", default=1800.0, show_default=True, help="Seconds to wait; then it is cancelled.")
@click.option("--json", "json_out", is_flag=True, help="Print the Result as JSON on stdout (all else on stderr).")
@redis_url_option()
def generate(prompt, output, size, num_frames, steps, seed, negative_prompt, guidance, guidance_2, boundary, fps,
             image, priority, user, quality, loras, model, timeout, json_out):
    """Generate one video on the live replicas, with a bar over its denoising steps; exit 0 once it is done."""
    from rich.console import Console
    from rich.markup import escape

    from replicadp_tasks.contract import validate_request

    from ..api import check_redis, model_for
    from ..oneshot import generate_one, need_a_replica, summary
    from ..ops.status import live_accepted

    request = {"prompt": prompt, "negative_prompt": negative_prompt, "seed": seed, "width": size[0],
               "height": size[1], "num_frames": num_frames, "num_inference_steps": steps, "guidance_scale": guidance,
               "guidance_scale_2": guidance_2, "boundary_ratio": boundary, "fps": fps, "image": image,
               "priority": priority, "user": user, "quality": quality, "loras": loras, "model": model}
    request = {k: v for k, v in request.items() if v is not None}
    try:
        # As the gateway checks: the form first, then against what the live replicas of its model accept (the
        # replica checks again).
        validate_request(request)
        check_redis()
        need_a_replica()
        request["model"] = chosen_model(model_for, model)
        validate_request(request, live_accepted(request["model"]))
    except InvalidRequest as exc:
        raise click.BadParameter(str(exc), param_hint=f"'{OPTION_OF.get(exc.field, exc.field)}'") from None
    err = Console(stderr=True, soft_wrap=True)  # as progress.console: messages are not wrapped
    out = err if json_out else console
    outcome = generate_one(request, timeout=timeout, output=output, err=err)
    if not outcome.ok:
        err.print(f"[red]request {outcome.task_id} failed[/red]: {escape(outcome.error)}")
        sys.exit(Exit.FAILED)
    if json_out:
        click.echo(json.dumps(outcome.result, indent=1))
    out.print(summary(outcome, output), markup=False, highlight=False)


@main.command()
@click.argument("request_id", metavar="ID")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
              help="Write its MP4 here (a completed request only).")
@click.option("--json", "json_out", is_flag=True, help="Print the state as JSON on stdout.")
@redis_url_option()
def get(request_id, output, json_out):
    """A request's state by its ID (the task id `generate` prints): queued, running (step), completed (its
    result), failed (why) or unknown; exit 0, or 1 if it failed, 4 if unknown."""
    from ..api import fetch_video
    from ..oneshot import Status, describe, status_of

    view = status_of(request_id)
    if json_out:
        click.echo(json.dumps(view, indent=1))
    else:
        console.print(describe(view), markup=False, highlight=False)
    if output is not None:
        if view["status"] != Status.COMPLETED:
            click.echo(f"no video written to {output}: the request is {view['status']}", err=True)
            sys.exit(Exit.NOT_FOUND if view["status"] == Status.UNKNOWN else Exit.FAILED)
        output.write_bytes(fetch_video(view["result"]))
        click.echo(f"wrote {output}", err=True)
    sys.exit({Status.FAILED: Exit.FAILED, Status.UNKNOWN: Exit.NOT_FOUND}.get(view["status"], Exit.OK))


@main.command()
@click.argument("request_id", metavar="ID")
@redis_url_option()
def cancel(request_id):
    """Cancel a request by its ID: a queued one never runs, a running one stops at its next denoising step; says
    which it was. Exit 0, or 4 if the request is unknown."""
    from ..oneshot import Status, cancel as do_cancel, describe_cancel

    view = do_cancel(request_id)
    console.print(describe_cancel(view), markup=False, highlight=False)
    sys.exit(Exit.NOT_FOUND if view["status"] == Status.UNKNOWN else Exit.OK)


@main.command()
@click.argument("request_id", metavar="ID")
@redis_url_option()
def preempt(request_id):
    """Preempt a running request by its ID: it stops at its next denoising step, its state saved, and goes back to
    the head of its priority list, to go on from there (REPLICADP_MAX_PREEMPTIONS at most). Exit 0 if it was
    preempted, 1 if it was not running its steps, 4 if it is unknown."""
    from replicadp_tasks.contract import Phase

    from ..oneshot import Status, describe_preempt, preempt as do_preempt

    view = do_preempt(request_id)
    console.print(describe_preempt(view), markup=False, highlight=False)
    running = view["status"] == Status.RUNNING and view["phase"] in (None, Phase.DENOISING)
    sys.exit(Exit.NOT_FOUND if view["status"] == Status.UNKNOWN else Exit.OK if running else Exit.FAILED)


@main.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--results", type=click.Path(dir_okay=False, path_type=Path),
              help="JSONL file results are appended to (default: FILE.results.jsonl).")
@click.option("--concurrency", default=0, show_default=True, help="Requests in flight at most; 0 = queue all.")
@click.option("--timeout", default=1800.0, show_default=True, help="Seconds per request.")
@click.option("--save-dir", type=click.Path(file_okay=False, path_type=Path), help="Fetch the MP4s into this folder.")
@click.option("--longest-first/--keep-order", default=True, show_default=True,
              help="Largest requests first (height x width x frames x steps: the shortest makespan for mixed "
                   "sizes), or in file order.")
@click.option("--priority", type=click.Choice([p.value for p in Priority]),
              help="For the lines that do not set one (default: normal).")
@click.option("--user", callback=user_param,
              help="Who the batch is for: lines that do not name one (round robin across users).")
@model_option(help="The model of the lines that do not name one (default: the deployment's).")
@redis_url_option()
def submit(file, results, concurrency, timeout, save_dir, longest_first, priority, user, model):
    """Submit a batch: JSONL (generate's arguments per line) or plain text (one prompt per line).

    Re-running the same file skips the requests that already completed."""
    from ..submit import BatchFileError, run_batch

    defaults = {k: v for k, v in (("priority", priority), ("user", user), ("model", model)) if v is not None}
    try:
        failed = run_batch(file, results or file.with_name(file.name + ".results.jsonl"), concurrency=concurrency,
                           timeout=timeout, save_dir=save_dir, longest=longest_first, defaults=defaults)
    except BatchFileError as exc:
        raise click.ClickException(str(exc))
    sys.exit(1 if failed else 0)


@main.command("webhook-secret")
@click.argument("tenant")
def webhook_secret(tenant):
    """Print the secret that signs TENANT's webhook events (an API key's owner id), derived from
    REPLICADP_WEBHOOK_SECRET: hand it to that tenant, whose receiver verifies X-Replicadp-Signature with it.
    Exit 0, or 2 without REPLICADP_WEBHOOK_SECRET or with a TENANT no key may have."""
    from replicadp_tasks.contract import tenant_secret

    deployment = os.environ.get("REPLICADP_WEBHOOK_SECRET", "")
    if not deployment:
        raise click.UsageError("REPLICADP_WEBHOOK_SECRET is not set: a tenant's secret is derived from it (set the "
                               "one the replicas use)")
    try:
        click.echo(tenant_secret(deployment, tenant))
    except InvalidRequest as exc:
        raise click.BadParameter(str(exc).removeprefix(f"{exc.field}="), param_hint="TENANT") from None
