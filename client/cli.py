"""The `replicadp` command: click commands over the rooms (client/bench, client/ops, client/local)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from enum import IntEnum
from pathlib import Path

import click

from replicadp_tasks.model.architectures import GPU_MEMORY_GIB, PEAK_TFLOPS
from replicadp_tasks.contract.errors import InvalidRequest
from replicadp_tasks.contract.scheduling import Priority, check_user
from replicadp_tasks.model.step_cache import Quality
from replicadp_tasks.contract.request import DEFAULTS, REFERENCE_SIZE, parse_size

from .api import ClientError, check_redis, use_redis
from .progress import console
from .ops.health import REPLY_TIMEOUT_S as HEALTH_REPLY_TIMEOUT_S
from .ops.health import STALL_S as HEALTH_STALL_S

PEAKS = "H200: 790, an estimate; A800: 312"


def size_param(ctx, param, value: str) -> tuple[int, int]:
    """A click callback: WIDTHxHEIGHT as (width, height)."""
    try:
        return parse_size(value, param.name)
    except InvalidRequest as exc:  # click names the option itself: drop the "size=" before the value
        raise click.BadParameter(str(exc).removeprefix(f"{exc.field}=")) from None


def layout_param(ctx, param, value: str):
    """A click callback: a REPLICADP_PARALLEL layout (replicadp_tasks.model.parallel.Layout)."""
    from replicadp_tasks.model.parallel import Layout

    try:
        return Layout.parse(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def user_param(ctx, param, value: str | None) -> str | None:
    """A click callback: a request's user, checked as a replica checks it."""
    try:
        return check_user(value)
    except InvalidRequest as exc:
        raise click.BadParameter(str(exc).removeprefix(f"{exc.field}=")) from None


def redis_url_option(help="Redis to use (default: `replicadp up`'s server, else 127.0.0.1:6379).", *,
                     expose: bool = False):
    """--redis-url, else REDIS_URL: this process is pointed at it before it connects to anything; with `expose`,
    the command gets it instead (None when neither is given) and points itself."""
    def point_at(ctx, param, url):
        if url:
            use_redis(url)

    # A password in the URL shows in `ps` when given on the command line: REDIS_URL keeps it off.
    return click.option("--redis-url", envvar="REDIS_URL", show_envvar=True, expose_value=expose,
                        callback=None if expose else point_at, metavar="URL", help=help)


class Exit(IntEnum):
    """The exit statuses of every command (docs/operations.md, "Exit statuses")."""

    OK = 0
    FAILED = 1  # a request failed, was cancelled or timed out; a check failed; the command's own error
    USAGE = 2  # click's: a bad option or argument, named
    UNAVAILABLE = 3  # a ClientError: Redis unreachable, no live replica, not the model asked for; nothing was run
    NOT_FOUND = 4  # get, cancel: no such request
    PORT_IN_USE = 5  # serve-http: something already listens on its --host:--port; nothing was started


class Unavailable(click.ClickException):
    """Raised when a ClientError ends a command: its message, and Exit.UNAVAILABLE."""

    exit_code = Exit.UNAVAILABLE


class PortInUse(click.ClickException):
    """Raised when serve-http's address is taken: its message names the address, and Exit.PORT_IN_USE."""

    exit_code = Exit.PORT_IN_USE


def check_listen(host: str, port: int) -> None:
    """Bind `host`:`port` as uvicorn will (its address family, SO_REUSEADDR) and let go, so that an address in use
    is said before anything starts (uvicorn would log it and exit 3, Exit.UNAVAILABLE's status): PortInUse, or a
    ClickException for any other reason it cannot be bound."""
    import errno
    import socket

    shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortInUse(f"{shown} is in use: another process listens there (another gateway?); give "
                                "another --port, or stop that process") from None
            raise click.ClickException(f"cannot listen on {shown}: {exc.strerror or exc}") from None


class Group(click.Group):
    """A ClientError (Redis unreachable, no live replica) ends any command with its message and Exit.UNAVAILABLE."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except ClientError as exc:
            raise Unavailable(str(exc)) from None


def json_to(ctx, param, path: Path | None) -> Path | None:
    """A click callback for --json FILE: `-` is stdout, which then carries the JSON alone (tables go to stderr)."""
    if path == Path("-"):
        console.file = sys.stderr
    return path


def write_json(path: Path, data: dict) -> None:
    if path == Path("-"):
        click.echo(json.dumps(data, indent=1))
    else:
        path.write_text(json.dumps(data, indent=1))
        console.print(f"written to {path}")


@click.group(cls=Group)
@click.version_option(package_name="replicadp", prog_name="replicadp")
def main():
    """replicadp: replica data parallelism for video diffusion models on Celery + Redis."""
    # SIGTERM unwinds like Ctrl-C, so the demo, sweep and bench stop what they started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


@main.command()
@click.option("--num-requests", default=16, show_default=True, help="Timed requests.")
@click.option("--concurrency", default=4, show_default=True, help="Requests in flight at most (closed loop).")
@click.option("--warmup", default=-1, show_default=True, help="Untimed warm-up requests; -1 = concurrency.")
@click.option("--base-seed", default=42, show_default=True, help="Request i gets seed base_seed + i.")
@click.option("--prompts-file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="One prompt per line (default: a built-in pool of 8).")
@click.option("--negative-prompt", default="", help="Negative prompt for every request.")
@click.option("--size", default=REFERENCE_SIZE, show_default=True, callback=size_param, help="WIDTHxHEIGHT.")
@click.option("--num-frames", default=DEFAULTS["num_frames"], show_default=True)
@click.option("--steps", default=DEFAULTS["num_inference_steps"], show_default=True, help="Denoising steps.")
@click.option("--model", default=None, help="Expected model; fail if the live replicas serve another.")
@click.option("--quality", type=click.Choice(["standard", "fast", "mixed"]), default="standard", show_default=True,
              help="The path each request asks for; mixed: standard and fast in turn (request i: fast if i is odd).")
@click.option("--loras", default="", metavar="NAME[,NAME]", help="Registered LoRA adapters to mix in: requests in "
              "turn run with none, the first, and the first at 0.5 with the second at 1.5.")
@click.option("--timeout", default=1800.0, show_default=True, help="Seconds per request.")
@click.option("--save-dir", type=click.Path(file_okay=False, path_type=Path), help="Write the MP4s here.")
@click.option("--label", default="", help="A name for this run in the report.")
@click.option("--baseline-tpm", type=float, help="One-replica videos/min, to print scaling and efficiency.")
@click.option("--write-baseline", type=click.Path(dir_okay=False, path_type=Path), help="Record output hashes per input.")
@click.option("--baseline-format", type=click.Choice(["replicadp", "vllm-omni"]),
              help="What --write-baseline writes: replicadp's (both hashes and the videos, for the PSNR of a "
                   "mismatch; the default) or vllm-omni's bench_replica_dp.py manifest (input key -> MP4 md5). "
                   "--check-baseline reads either.")
@click.option("--check-baseline", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Compare output hashes per input with a recorded baseline (replicadp's or vllm-omni's).")
@click.option("--tolerance-psnr", type=float, metavar="DB",
              help="With --check-baseline: also pass a mismatch whose decoded video has a PSNR of at least DB dB "
                   "against its own baseline, higher than against any other input's (for hardware whose kernels "
                   "cannot be made deterministic; off: bit-exact only).")
@click.option("--peak-tflops", default=PEAK_TFLOPS, show_default=True,
              help=f"The chip's bf16 TFLOP/s, for the DiT's model FLOP utilisation ({PEAKS}).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, allow_dash=True, path_type=Path), callback=json_to,
              help="Write the report as JSON to this file, or to stdout with - (the tables then go to stderr).")
@redis_url_option()
def bench(num_requests, concurrency, warmup, base_seed, prompts_file, negative_prompt, size, num_frames, steps,
          model, quality, loras, timeout, save_dir, label, baseline_tpm, write_baseline, baseline_format,
          check_baseline, tolerance_psnr, peak_tflops, json_out):
    """Throughput benchmark (vllm-omni's bench_replica_dp protocol) with an optional isolation check."""
    from .bench.isolation import BaselineError, BaselineFormat, read_baseline
    from .bench.report import print_report
    from .bench.run import PROMPTS, BenchConfig, run_bench

    if write_baseline and check_baseline:
        raise click.UsageError("--write-baseline and --check-baseline are exclusive: record first, then check")
    if tolerance_psnr is not None and not check_baseline:
        raise click.UsageError(f"--tolerance-psnr {tolerance_psnr:g}: only with --check-baseline")
    if baseline_format and not write_baseline:
        raise click.UsageError(f"--baseline-format {baseline_format}: only with --write-baseline (a check reads "
                               "either)")
    vllm_omni = baseline_format == BaselineFormat.VLLM_OMNI
    if check_baseline:
        try:
            vllm_omni = read_baseline(check_baseline)[0] == BaselineFormat.VLLM_OMNI
        except BaselineError as exc:
            raise click.BadParameter(str(exc), param_hint="--check-baseline")
        if vllm_omni and tolerance_psnr is not None:
            raise click.UsageError(f"--tolerance-psnr {tolerance_psnr:g}: {check_baseline} is vllm-omni's baseline, "
                                   "which keeps no videos to compare")
    if vllm_omni and quality != "standard":
        raise click.UsageError(f"--quality {quality}: vllm-omni's baseline keys carry no quality; only with "
                               "--quality standard")
    loras = tuple(name.strip() for name in loras.split(",") if name.strip())
    if vllm_omni and loras:
        raise click.UsageError("--loras: vllm-omni's baseline keys carry no adapters")
    if num_requests < 1 or concurrency < 1:
        raise click.UsageError("--num-requests and --concurrency must be at least 1")
    prompts = PROMPTS
    if prompts_file:
        prompts = tuple(line.strip() for line in prompts_file.read_text().splitlines() if line.strip())
        if not prompts:
            raise click.BadParameter(f"{prompts_file}: no prompts", param_hint="--prompts-file")
    cfg = BenchConfig(num_requests=num_requests, concurrency=concurrency, warmup=warmup, base_seed=base_seed,
                      prompts=prompts, negative_prompt=negative_prompt, width=size[0], height=size[1],
                      num_frames=num_frames, steps=steps, quality=quality, loras=loras, timeout=timeout,
                      label=label, peak_tflops=peak_tflops)
    rep = run_bench(cfg, model=model, save_dir=save_dir, baseline_tpm=baseline_tpm, write_baseline=write_baseline,
                    baseline_format=BaselineFormat(baseline_format or BaselineFormat.REPLICADP),
                    check_baseline=check_baseline, tolerance_psnr=tolerance_psnr)
    print_report(rep)
    if json_out:
        write_json(json_out, rep)
    isolation = rep.get("isolation")
    sys.exit(0 if rep["failed"] == 0 and (isolation is None or isolation.get("passed", True)) else 1)


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
@redis_url_option()
def submit(file, results, concurrency, timeout, save_dir, longest_first, priority, user):
    """Submit a batch: JSONL (generate's arguments per line) or plain text (one prompt per line).

    Re-running the same file skips the requests that already completed."""
    from .submit import BatchFileError, run_batch

    defaults = {k: v for k, v in (("priority", priority), ("user", user)) if v is not None}
    try:
        failed = run_batch(file, results or file.with_name(file.name + ".results.jsonl"), concurrency=concurrency,
                           timeout=timeout, save_dir=save_dir, longest=longest_first, defaults=defaults)
    except BatchFileError as exc:
        raise click.ClickException(str(exc))
    sys.exit(1 if failed else 0)


# generate's option for each request field, so that a value the request check refuses is a usage error naming it.
OPTION_OF = {"prompt": "PROMPT", "negative_prompt": "--negative-prompt", "seed": "--seed", "height": "--size",
             "width": "--size", "num_frames": "--num-frames", "num_inference_steps": "--steps",
             "guidance_scale": "--guidance", "guidance_scale_2": "--guidance-2", "boundary_ratio": "--boundary",
             "fps": "--fps", "image": "--image", "priority": "--priority", "user": "--user", "quality": "--quality",
             "loras": "--lora"}


def lora_param(ctx, param, values: tuple[str, ...]) -> list[dict] | None:
    """A click callback for --lora NAME[:SCALE] (repeated): generate's `loras`; the request check names the rest."""
    loras = []
    for value in values:
        name, sep, scale = value.partition(":")
        try:
            loras.append({"name": name, **({"scale": float(scale)} if sep else {})})
        except ValueError:
            raise click.BadParameter(f"{value!r}: expected NAME or NAME:SCALE (a number)") from None
    return loras or None


def image_param(ctx, param, value: str | None) -> str | None:
    """A click callback for --image: an http(s) URL goes as it is (the replica fetches it under its policy), a local
    file as a data URI, so that it reaches a replica on any host."""
    import base64
    import mimetypes

    from replicadp_tasks.settings import SETTINGS

    if value is None or value.startswith(("http://", "https://")):
        return value
    path = Path(value)
    if not path.is_file():
        raise click.BadParameter(f"{value!r}: no such file (give a file or an http(s) URL)")
    if path.stat().st_size > SETTINGS.max_image_bytes:
        raise click.BadParameter(f"{value!r}: {path.stat().st_size} bytes, over REPLICADP_MAX_IMAGE_BYTES="
                                 f"{SETTINGS.max_image_bytes}")
    mime = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    return f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode()}"


@main.command()
@click.argument("prompt")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the MP4 here (default: it stays in the output store; the summary says where).")
@click.option("--size", default=REFERENCE_SIZE, show_default=True, callback=size_param, help="WIDTHxHEIGHT.")
@click.option("--num-frames", default=DEFAULTS["num_frames"], show_default=True)
@click.option("--steps", default=DEFAULTS["num_inference_steps"], show_default=True, help="Denoising steps.")
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
@click.option("--timeout", default=1800.0, show_default=True, help="Seconds to wait; then it is cancelled.")
@click.option("--json", "json_out", is_flag=True, help="Print the Result as JSON on stdout (all else on stderr).")
@redis_url_option()
def generate(prompt, output, size, num_frames, steps, seed, negative_prompt, guidance, guidance_2, boundary, fps,
             image, priority, user, quality, loras, timeout, json_out):
    """Generate one video on the live replicas, with a bar over its denoising steps; exit 0 once it is done."""
    from rich.console import Console
    from rich.markup import escape

    from replicadp_tasks.contract.request import validate_request

    from .oneshot import generate_one, summary
    from .ops.status import live_accepted

    request = {"prompt": prompt, "negative_prompt": negative_prompt, "seed": seed, "width": size[0],
               "height": size[1], "num_frames": num_frames, "num_inference_steps": steps, "guidance_scale": guidance,
               "guidance_scale_2": guidance_2, "boundary_ratio": boundary, "fps": fps, "image": image,
               "priority": priority, "user": user, "quality": quality, "loras": loras}
    request = {k: v for k, v in request.items() if v is not None}
    accepted = live_accepted()
    try:
        # As the gateway checks: against the live replicas' size multiple and qualities (with none live, 16 and
        # any quality; the replica checks again).
        validate_request(request, size_multiple=accepted.size_multiple, qualities=accepted.qualities,
                         experts=accepted.experts, requires_image=accepted.requires_image, loras=accepted.loras)
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
    from .api import fetch_video
    from .oneshot import Status, describe, status_of

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
    from .oneshot import Status, cancel as do_cancel, describe_cancel

    view = do_cancel(request_id)
    console.print(describe_cancel(view), markup=False, highlight=False)
    sys.exit(Exit.NOT_FOUND if view["status"] == Status.UNKNOWN else Exit.OK)


@main.command("webhook-secret")
@click.argument("tenant")
def webhook_secret(tenant):
    """Print the secret that signs TENANT's webhook events (an API key's owner id), derived from
    REPLICADP_WEBHOOK_SECRET: hand it to that tenant, whose receiver verifies X-Replicadp-Signature with it.
    Exit 0, or 2 without REPLICADP_WEBHOOK_SECRET or with a TENANT no key may have."""
    from replicadp_tasks.webhooks.events import tenant_secret

    deployment = os.environ.get("REPLICADP_WEBHOOK_SECRET", "")
    if not deployment:
        raise click.UsageError("REPLICADP_WEBHOOK_SECRET is not set: a tenant's secret is derived from it (set the "
                               "one the replicas use)")
    try:
        click.echo(tenant_secret(deployment, tenant))
    except InvalidRequest as exc:
        raise click.BadParameter(str(exc).removeprefix(f"{exc.field}="), param_hint="TENANT") from None


@main.command()
@click.option("--watch", is_flag=True, help="Refresh every second until Ctrl-C.")
@click.option("--json", "json_out", is_flag=True, help="Print the snapshot as JSON on stdout, once.")
@redis_url_option()
def status(watch, json_out):
    """Live replicas (each one's fast path: the step cache of quality=fast), the request each is running and its
    step, queue depth, recent throughput."""
    from rich.live import Live

    from .ops.status import snapshot, table

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

    from .api import redacted
    from .local.replicas import plan, visible_gpus
    from .local.replicas import up as do_up

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
    from .local.replicas import down as do_down

    state = do_down()
    console.print("nothing is up" if state is None else f"stopped {len(state['replicas'])} replica(s)")


@main.command()
@click.option("--num-requests", default=24, show_default=True)
@click.option("--concurrency", default=4, show_default=True, help="In flight during the 2-replica run.")
@click.option("--size", default="128x128", show_default=True, callback=size_param)
@click.option("--num-frames", default=17, show_default=True)
@click.option("--steps", default=8, show_default=True)
@click.option("--model", default="tiny", show_default=True)
@click.option("--output-dir", default="outputs/demo", show_default=True, type=click.Path(file_okay=False, path_type=Path))
@redis_url_option(help="Redis to run on (default: an embedded server, started here).", expose=True)
def demo(num_requests, concurrency, size, num_frames, steps, model, output_dir, redis_url):
    """1 replica records a baseline, 2 replicas replay it under concurrency: throughput and isolation."""
    from .bench.demo import DemoConfig, DemoFailed, run_demo
    from .bench.report import print_demo

    if num_requests < 1 or concurrency < 1:
        raise click.UsageError("--num-requests and --concurrency must be at least 1")
    cfg = DemoConfig(num_requests=num_requests, concurrency=concurrency, width=size[0], height=size[1],
                     num_frames=num_frames, steps=steps, model=model, output_dir=output_dir)
    try:
        reports, iso = run_demo(cfg, log=lambda m: console.print(f"[dim]{m}[/dim]"), redis_url=redis_url)
    except (DemoFailed, RuntimeError, TimeoutError) as exc:  # RuntimeError, TimeoutError: replicas that did not start
        raise click.ClickException(str(exc))
    print_demo(cfg, reports, iso)
    sys.exit(0 if iso["passed"] and all(r["failed"] == 0 for r in reports) else 1)


@main.command()
@click.option("--replicas", "counts", default="1,2,4,8", show_default=True, help="Replica counts to run, comma-separated.")
@click.option("--model", default="tiny", show_default=True,
              help="Model spec for the replicas; synthetic:SECONDS is the benchmark-only backend.")
@click.option("--devices", default="cpu", show_default=True, help="GPU ids (the first N are used at N) or cpu.")
@click.option("--threads", type=int, default=1, show_default=True, help="CPU threads per replica (cpu only).")
@click.option("--num-requests", default=32, show_default=True, help="Rounded up to a multiple of every N.")
@click.option("--concurrency", default=0, show_default=True, help="In flight at most; 0 = 2 x replicas.")
@click.option("--warmup", default=-1, show_default=True, help="Untimed requests per N; -1 = N.")
@click.option("--base-seed", default=42, show_default=True)
@click.option("--size", default=REFERENCE_SIZE, show_default=True, callback=size_param)
@click.option("--num-frames", default=DEFAULTS["num_frames"], show_default=True)
@click.option("--steps", default=DEFAULTS["num_inference_steps"], show_default=True)
@click.option("--timeout", default=1800.0, show_default=True)
@click.option("--out", default="bench-results/sweep", show_default=True, type=click.Path(path_type=Path),
              help="Output prefix: writes PREFIX.json, PREFIX.md and PREFIX.png.")
@redis_url_option(help="Redis to run on (default: an embedded server, started here).", expose=True)
def sweep(counts, model, devices, threads, num_requests, concurrency, warmup, base_seed, size, num_frames, steps,
          timeout, out, redis_url):
    """Run the same bench at each replica count; print the scaling table, write JSON, Markdown and a PNG."""
    from .bench.report import print_sweep
    from .bench.run import BenchConfig
    from .bench.sweep import even_request_count, run_sweep, table_title, write_outputs

    try:
        ns = sorted({int(x) for x in counts.split(",")})
        if ns[0] < 1:
            raise ValueError
    except ValueError:
        raise click.BadParameter(f"{counts!r}: expected positive integers like 1,2,4,8", param_hint="--replicas")
    total = even_request_count(num_requests, ns)
    if total != num_requests:
        console.print(f"--num-requests {num_requests} -> {total}: a multiple of every N, so that no replica idles "
                      "through an uneven tail")
    cfg = BenchConfig(num_requests=total, concurrency=concurrency, warmup=warmup, base_seed=base_seed,
                      width=size[0], height=size[1], num_frames=num_frames, steps=steps, timeout=timeout)
    reports = run_sweep(ns, cfg, model=model, threads=threads, devices=devices,
                        log=lambda m: console.print(f"[dim]{m}[/dim]"), env={"HF_HUB_OFFLINE": "1"},
                        redis_url=redis_url)
    title = table_title(model, devices, threads, cfg)
    print_sweep(reports, title)
    paths = write_outputs(reports, out, title)
    console.print("wrote " + ", ".join(map(str, paths)))
    sys.exit(0 if all(r["failed"] == 0 for r in reports) else 1)


@main.command("serve-http")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8098, show_default=True)
@click.option("--max-queue", default=64, show_default=True, envvar="REPLICADP_HTTP_MAX_QUEUE",
              help="Requests waiting in the queue past which new ones get 429 (env REPLICADP_HTTP_MAX_QUEUE).")
@click.option("--sync-timeout", default=1800.0, show_default=True, envvar="REPLICADP_HTTP_SYNC_TIMEOUT",
              help="Seconds a /v1/videos/sync request waits before a 504 (env REPLICADP_HTTP_SYNC_TIMEOUT).")
@click.option("--shutdown-grace", default=10.0, show_default=True, type=click.FloatRange(min=0),
              envvar="REPLICADP_HTTP_SHUTDOWN_GRACE",
              help="Seconds a graceful stop (SIGTERM) waits for /v1/videos/sync requests in flight; those still "
                   "waiting then get a 503 with their job id and go on running (env REPLICADP_HTTP_SHUTDOWN_GRACE).")
@click.option("--api-key", "api_keys", multiple=True, envvar="REPLICADP_API_KEYS", metavar="KEY",
              help="A bearer token /v1 accepts; repeat for several (env REPLICADP_API_KEYS, space-separated). "
                   "Without keys the API is open.")
@click.option("--api-keys-file", "key_files", multiple=True, envvar="REPLICADP_API_KEYS_FILE",
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="A file of API keys, one per line, # comments (env REPLICADP_API_KEYS_FILE).")
@click.option("--allowed-hosts", "hosts", multiple=True, envvar="REPLICADP_ALLOWED_HOSTS", metavar="NAME",
              help="A Host name the gateway answers, any port; repeat for several, '*' for any (env "
                   "REPLICADP_ALLOWED_HOSTS, space-separated). Default: localhost, 127.0.0.1 and [::1] when --host "
                   "is loopback, any otherwise. Others get 400 (a DNS-rebound name); /health answers every name.")
@click.option("--docs/--no-docs", default=False, show_default=True, envvar="REPLICADP_HTTP_DOCS",
              help="Serve FastAPI's interactive /docs and /redoc, which load their scripts from a CDN "
                   "(env REPLICADP_HTTP_DOCS). /openapi.json is served either way.")
@click.option("--max-connections", type=click.IntRange(min=1), envvar="REPLICADP_HTTP_MAX_CONNECTIONS",
              help="Open connections past which a request gets 503 at once, /health too (env "
                   "REPLICADP_HTTP_MAX_CONNECTIONS). Default: the open-file limit (ulimit -n) less 128.")
@click.option("--header-timeout", default=10.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              envvar="REPLICADP_HTTP_HEADER_TIMEOUT",
              help="Seconds a connection has to send a request's headers, from its opening or its last answer, "
                   "before it is closed (env REPLICADP_HTTP_HEADER_TIMEOUT).")
@click.option("--keep-alive", default=5, show_default=True, type=click.IntRange(min=1),
              envvar="REPLICADP_HTTP_KEEP_ALIVE",
              help="Seconds an idle keep-alive connection stays open (env REPLICADP_HTTP_KEEP_ALIVE).")
@redis_url_option()
def serve_http(host, port, max_queue, sync_timeout, shutdown_grace, api_keys, key_files, hosts, docs,
               max_connections, header_timeout, keep_alive):
    """HTTP front door: vllm-omni's video API (/v1/videos, /v1/videos/sync) in front of the replicas."""
    import logging.config

    from replicadp_tasks.logs import uvicorn_config
    from replicadp_tasks.settings import SETTINGS

    from .http import create_app
    from .http.app import serve
    from .http.auth import ApiKeyError, read_keys
    from .http.guard import allowed_hosts

    try:
        keys = read_keys(api_keys, key_files)
    except ApiKeyError as exc:
        raise click.BadParameter(str(exc), param_hint="--api-key / --api-keys-file")
    check_listen(host, port)
    check_redis()
    log_config = uvicorn_config(SETTINGS.log_format)
    logging.config.dictConfig(log_config)  # before uvicorn does: these lines are in the gateway's format too
    log = logging.getLogger("uvicorn.error")
    if keys:
        log.info("API keys: %d, of %d tenants; /v1 answers 401 without one of them", len(keys),
                 len({key.owner for key in keys}))
    elif host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("no API keys: anyone who reaches %s:%d can create, list and delete jobs (--api-key, "
                    "REPLICADP_API_KEYS)", host, port)
    shown = f"[{host}]" if ":" in host else host
    log.info("web page: http://%s:%d/ui (docs/ui.md)", shown, port)
    api = create_app(max_queue=max_queue, sync_timeout=sync_timeout, api_keys=keys,
                     allowed_hosts=allowed_hosts(hosts, host), docs=docs)
    serve(api, host=host, port=port, grace=shutdown_grace, log_config=log_config, max_connections=max_connections,
          header_timeout=header_timeout, keep_alive=keep_alive)


@main.command()
@click.option("--address", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0 only in a container whose port is published on loopback).")
@click.option("--port", default=5555, show_default=True)
@redis_url_option()
def flower(address, port):
    """Flower, the Celery dashboard (replicas, requests), behind basic auth: FLOWER_BASIC_AUTH=user:password,
    else a generated password, printed once."""
    from .ops.flower import CredentialsError, credentials, exec_flower

    try:
        auth, generated = credentials(os.environ)
    except CredentialsError as exc:
        raise click.ClickException(str(exc))
    check_redis()
    if generated:
        console.print(f"Flower basic auth (generated, shown once): {auth}")
    console.print(f"Flower on http://{address}:{port}/")
    exec_flower(address, port, auth)


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0 only in a container whose port is published on loopback).")
@click.option("--port", default=9808, show_default=True)
@redis_url_option()
def metrics(host, port):
    """Prometheus exporter: queue depth and wait, replica busy/idle, requests completed and failed, latency and
    queue-wait histograms."""
    from .ops.metrics import serve

    check_redis()
    console.print(f"metrics on http://{host}:{port}/metrics")
    try:
        serve(host, port)
    except OSError as exc:
        raise click.ClickException(f"--host {host} --port {port}: {exc}")


@main.command()
@click.option("--replica", required=True, help="Node name, e.g. replica0@%h (%h: this host, as in `celery worker -n`).")
@click.option("--stall-after", default=HEALTH_STALL_S, show_default=True,
              help="Seconds without progress (same step, or idle beside a waiting request) that are unhealthy.")
@click.option("--timeout", default=HEALTH_REPLY_TIMEOUT_S, show_default=True, help="Seconds to wait for each reply.")
@redis_url_option()
def health(replica, stall_after, timeout):
    """Exit 0 if the replica serves (answers, consumes the queue, makes progress), else 1; one line says why.
    For docker-compose's healthcheck."""
    from .ops.health import check

    try:
        check_redis(timeout=timeout)
    except ClientError as exc:  # a healthcheck's verdict, not an error
        click.echo(f"unhealthy: {exc}")
        sys.exit(1)
    verdict = check(replica, stall_s=stall_after, timeout=timeout)
    click.echo(f"{'healthy' if verdict.healthy else 'unhealthy'}: {verdict.reason}")
    sys.exit(0 if verdict.healthy else 1)


@main.command("make-tiny-model")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--variant", type=click.Choice(["wan2.2-ti2v", "wan2.1-t2v", "wan2.2-t2v-a14b", "wan2.2-i2v-a14b"]),
              default="wan2.2-ti2v", show_default=True)
def make_tiny_model(directory, variant):
    """Write a tiny random-weight Wan pipeline (save_pretrained layout) for offline tests and demos."""
    from replicadp_tasks.model.tiny_model import ensure_tiny_model

    console.print(f"tiny {variant} model in {ensure_tiny_model(directory, variant)}")


@main.command("make-tiny-lora")
@click.argument("out_file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--model", default="tiny", show_default=True, help="The tiny model it adapts (tiny, tiny-a14b, ...).")
@click.option("--seed", default=0, show_default=True, help="Its random weights' seed: another seed, another adapter.")
@click.option("--expert", type=click.Choice(["transformer", "transformer_2"]), default="transformer",
              show_default=True)
def make_tiny_lora(out_file, model, seed, expert):
    """Write a small random LoRA adapter (peft, seeded) for a tiny model, as one safetensors file that
    REPLICADP_LORAS can register: for trying adapters offline."""
    from replicadp_tasks.model.pipeline import TINY_SPECS, resolve_model
    from replicadp_tasks.settings import SETTINGS
    from replicadp_tasks.model.tiny_model import save_tiny_lora

    if model not in TINY_SPECS:
        raise click.BadParameter(f"{model!r}: one of {', '.join(TINY_SPECS)}", param_hint="--model")
    path = save_tiny_lora(resolve_model(model, SETTINGS.model_cache), out_file, seed, expert=expert)
    console.print(f"LoRA for {model}'s {expert} (seed {seed}) in {path}")


@main.command("calibrate-mag")
@click.option("--model", default=lambda: os.environ.get("REPLICADP_MODEL", "tiny"), show_default="REPLICADP_MODEL, else tiny",
              help="The served model, as its replicas name it.")
@click.option("--size", default=REFERENCE_SIZE, show_default=True, callback=size_param, help="WIDTHxHEIGHT.")
@click.option("--num-frames", default=DEFAULTS["num_frames"], show_default=True)
@click.option("--steps", default=DEFAULTS["num_inference_steps"], show_default=True,
              help="Denoising steps; requests with another count use the ratios interpolated.")
@click.option("--prompts", default=2, show_default=True, type=click.IntRange(1, 64), help="Requests averaged.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path),
              help="Default: REPLICADP_MAG_RATIOS, else the model cache's file for the model (where replicas look).")
def calibrate_mag_cmd(model, size, num_frames, steps, prompts, out):
    """MagCache's ratios for REPLICADP_CACHE=mag, measured on MODEL here (this process's GPU, else the CPU):
    the exact path on a few requests, the residual magnitude ratio at each step, written where replicas read it."""
    from replicadp_tasks.contract.errors import ModelLoadError

    from .ops.calibrate import calibrate, ratios_path

    out = out or ratios_path(model)
    try:
        saved = calibrate(model, width=size[0], height=size[1], num_frames=num_frames, steps=steps, prompts=prompts,
                          out=out)
    except (ModelLoadError, InvalidRequest) as exc:
        raise click.ClickException(str(exc))
    console.print(f"MagCache ratios of {model!r} ({steps} steps, {prompts} requests, {saved['seconds']:.1f} s on "
                  f"{saved['device']}) written to {out}")


@main.command("describe-model")
@click.argument("spec")
@click.option("--size", default=REFERENCE_SIZE, show_default=True, callback=size_param, help="WIDTHxHEIGHT, for the FLOPs.")
@click.option("--num-frames", default=DEFAULTS["num_frames"], show_default=True)
@click.option("--steps", default=DEFAULTS["num_inference_steps"], show_default=True)
@click.option("--peak-tflops", default=PEAK_TFLOPS, show_default=True, help=f"The chip's bf16 TFLOP/s ({PEAKS}).")
@click.option("--gpus", default=1, show_default=True, type=click.IntRange(1, 8),
              help="GPUs per replica (GPUS_PER_REPLICA), for the memory check.")
@click.option("--gpu-memory-gib", default=GPU_MEMORY_GIB, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Each GPU's memory, for the memory check.")
@click.option("--parallel", "layout", default="none", envvar="REPLICADP_PARALLEL", show_default=True,
              show_envvar=True, callback=layout_param, help="A layout over K ranks: each rank's share.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, allow_dash=True, path_type=Path), callback=json_to,
              help="Write the figures as JSON to this file, or to stdout with - (the table then goes to stderr).")
def describe_model(spec, size, num_frames, steps, peak_tflops, gpus, gpu_memory_gib, layout, json_out):
    """Each component's parameter count and size, built on the meta device (nothing is allocated), each
    transformer expert's FLOPs per request, and whether the replica's GPUs hold the weights. SPEC: random:ARCH
    (or ARCH), or a tiny spec (tiny, tiny-wan2.1, tiny-a14b, tiny-i2v-a14b)."""
    from .bench.describe import architecture_of, figures, print_figures

    try:
        name = architecture_of(spec)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="SPEC")
    from replicadp_tasks.contract.errors import ModelLoadError
    from replicadp_tasks.settings import SETTINGS

    try:
        fig = figures(name, width=size[0], height=size[1], num_frames=num_frames, steps=steps,
                      peak_tflops=peak_tflops, gpus=gpus, gpu_memory_gib=gpu_memory_gib, layout=layout,
                      loras_file=SETTINGS.loras_file)
    except ModelLoadError as exc:  # REPLICADP_LORAS's file
        raise click.ClickException(str(exc))
    print_figures(fig)
    if json_out:
        write_json(json_out, fig)
