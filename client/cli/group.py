"""The `replicadp` click group that every command module of client/cli/ registers its commands on."""

from __future__ import annotations

import signal
import sys

import click

from .options import Group


@click.group(cls=Group)
@click.version_option(package_name="replicadp", prog_name="replicadp")
def main():
    """replicadp: replica data parallelism for video diffusion models on Celery + Redis."""
    # SIGTERM unwinds like Ctrl-C, so the demo, sweep and bench stop what they started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
