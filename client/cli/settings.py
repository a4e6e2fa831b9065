"""`replicadp settings`: the settings this process reads (replicadp_tasks/settings.py), each variable with its value
here and its default; with --markdown, the reference table that docs/configuration.md is."""

from __future__ import annotations

from enum import Enum
from pathlib import Path

import click

from ..progress import console
from .group import main

MARKDOWN_HEAD = ("# Configuration\n\nEvery setting is an environment variable, read once when a process starts "
                 "(replicadp_tasks/settings.py); this\nfile is written by "
                 "`replicadp settings --markdown > docs/configuration.md`.\n")


def shown(value) -> str:
    """A setting's value as the table and docs/configuration.md show it: the same on every host (`~` for the home
    folder) and never an empty cell."""
    if value is None:
        return "unset"
    if isinstance(value, bool):  # as the variable is written (settings.boolean: "use 1 or 0")
        return "1" if value else "0"
    if isinstance(value, Enum):
        return str(value.value)
    if isinstance(value, tuple):
        return ", ".join(map(shown, value)) or "none"
    if isinstance(value, Path) and value.is_relative_to(Path.home()):
        return str(Path("~") / value.relative_to(Path.home()))
    if isinstance(value, str) and not value:
        return "empty"
    return str(value)


def default_of(setting) -> str:
    """A Setting's default: its default_text, else its value; a default computed from other settings that has no
    text to show for it is "computed"."""
    if setting.default_text is not None:
        return setting.default_text
    return "computed" if callable(setting.default) else shown(setting.default)


def markdown() -> str:
    """docs/configuration.md: every setting in declaration order, with its default and why. It reads no
    environment: the same text on every host."""
    from replicadp_tasks.settings import reference

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    rows = [f"| `{s.variable}` | {cell(default_of(s))} | {cell(s.why)} |" for s in reference()]
    return "\n".join([MARKDOWN_HEAD, "| variable | default | why |", "|---|---|---|", *rows]) + "\n"


def table():
    """This process's settings as a rich table: variable, value, default; a secret's value hidden, and a Redis URL's
    passwords."""
    from dataclasses import fields

    from rich.table import Table
    from rich.text import Text

    from replicadp_tasks.cluster import redacted
    from replicadp_tasks.settings import SETTINGS, Settings, redis_url

    grid = Table("variable", "value", "default", title="replicadp settings (environment variables, read at start)")
    grid.columns[0].no_wrap = True
    for column in grid.columns[1:]:
        column.overflow = "fold"  # a long path has no space to wrap at: fold it rather than cut it
    for f in fields(Settings):
        s = f.metadata["setting"]
        value = getattr(SETTINGS, f.name)
        if not f.repr:  # a secret (repr=False): say whether it is set, never what it is
            value = "***" if value else shown(value)
        elif s.parse is redis_url:  # a Redis URL may carry passwords
            value = redacted(value)
        else:
            value = shown(value)
        grid.add_row(s.variable, Text(value), Text(default_of(s)))  # Text: a value's brackets are not markup
    return grid


@main.command()
@click.option("--markdown", "as_markdown", is_flag=True,
              help="Print the reference table as Markdown instead (variable, default, why): docs/configuration.md.")
def settings(as_markdown):
    """The settings this process reads, one environment variable each: its value here and its default (a secret's
    value hidden)."""
    if as_markdown:
        click.echo(markdown(), nl=False)
    else:
        console.print(table())
