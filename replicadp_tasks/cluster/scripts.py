"""Redis's Lua scripts: each in a .lua file beside the module that runs it (as dramatiq's brokers/redis/*.lua),
read once, when that module is imported."""

from __future__ import annotations

from importlib import resources


def lua(package: str, name: str) -> str:
    """The text of `name`.lua in `package` (the calling module's __package__), without its comment lines: they
    document the file, and a script sent with EVAL would carry them on every call."""
    text = resources.files(package).joinpath(f"{name}.lua").read_text()
    return "".join(line for line in text.splitlines(keepends=True) if not line.lstrip().startswith("--"))
