"""What the `replicadp` commands share: click callbacks for their options (sizes, layouts, users, adapters, images,
--redis-url, --json), the exit statuses (`Exit`) and the exceptions that end a command with one, and the click
group class that turns a ClientError into Exit.UNAVAILABLE."""

from __future__ import annotations

import json
import sys
from enum import IntEnum
from pathlib import Path

import click

from replicadp_tasks.contract import InvalidRequest, check_user, parse_size

from ..api import ClientError, use_redis
from ..progress import console

PEAKS = "H200: 790, an estimate; A800: 312"

# generate's option for each request field, so that a value the request check refuses is a usage error naming it.
OPTION_OF = {"prompt": "PROMPT", "negative_prompt": "--negative-prompt", "seed": "--seed", "height": "--size",
             "width": "--size", "num_frames": "--num-frames", "num_inference_steps": "--steps",
             "guidance_scale": "--guidance", "guidance_scale_2": "--guidance-2", "boundary_ratio": "--boundary",
             "fps": "--fps", "image": "--image", "priority": "--priority", "user": "--user", "quality": "--quality",
             "loras": "--lora", "model": "--model"}


def size_param(ctx, param, value: str) -> tuple[int, int]:
    """A click callback: WIDTHxHEIGHT as (width, height)."""
    try:
        return parse_size(value, param.name)
    except InvalidRequest as exc:  # click names the option itself: drop the "size=" before the value
        raise click.BadParameter(str(exc).removeprefix(f"{exc.field}=")) from None


def layout_param(ctx, param, value: str):
    """A click callback: a REPLICADP_PARALLEL layout (replicadp_tasks.model.parallel.Layout)."""
    from replicadp_tasks.model import Layout

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


def model_option(help="The model to run on (default: the deployment's: REPLICADP_DEFAULT_MODEL, else the one "
                      "it serves).", **kwargs):
    """--model NAME: a model the deployment serves, resolved in the command (after --redis-url) by chosen_model."""
    return click.option("--model", metavar="NAME", help=help, **kwargs)


def chosen_model(model_for, asked: str | None) -> str:
    """The model a command's request runs on (client.api.model_for): a usage error naming --model and the served
    ones (Exit.USAGE) for one the deployment does not serve, or none named where it serves several."""
    try:
        return model_for(asked)
    except InvalidRequest as exc:
        raise click.BadParameter(str(exc).removeprefix("model=").removeprefix("model: "),
                                 param_hint="'--model'") from None


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
