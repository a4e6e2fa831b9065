"""The house's rooms hold: no import circle in replicadp_tasks/ or client/, dependencies that run one way (the
contract and the model import no Celery, no Redis and no settings), and client/ reaching the worker side through
the rooms' faces only. Read from the code's own imports (every `import`, at the top of a module or inside a
function), nothing run but one interpreter that imports each module of the two pure rooms on its own."""

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("replicadp_tasks", "client")
ROOMS = ("contract", "model", "cluster", "broker", "replica", "inputs", "outputs", "webhooks")
# What the contract and the model may not import: they are read by producers and pipelines that hold no Celery
# worker, no Redis connection and no deployment's settings (those come in as arguments). Nor may the cluster room
# (Redis clients) import Celery or the settings, which import it.
FORBIDDEN = {"contract": ("celery", "kombu", "billiard", "redis", "replicadp_tasks.settings"),
             "model": ("celery", "kombu", "billiard", "redis", "replicadp_tasks.settings"),
             "cluster": ("celery", "kombu", "billiard", "replicadp_tasks.settings")}
# Which rooms each room may import (the contract is everyone's; the replica is the only room that runs them all).
MAY_IMPORT = {"contract": set(), "model": {"contract"}, "inputs": {"contract"},
              "cluster": {"contract"}, "broker": {"contract", "cluster"}, "outputs": {"contract", "cluster"},
              "webhooks": {"contract", "cluster", "inputs"},
              "replica": {"contract", "model", "cluster", "broker", "inputs", "outputs", "webhooks"}}
# Modules at the top of replicadp_tasks that client/ may import besides the rooms' faces.
TOP = {"replicadp_tasks", "replicadp_tasks.app", "replicadp_tasks.settings", "replicadp_tasks.logs"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> dict[str, set[str]]:
    """What `name` imports anywhere in its code, as Python runs it: each module it names (`from . import x` and
    `from .x import y` name the submodule where there is one) and the packages above it, each package's face run
    first, except those `name` is inside of (they are being imported already). Keyed by the import statement's
    own module path (what a face check reads), valued by the modules that import makes Python run."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    inside = {".".join(package.split(".")[:i]) for i in range(1, package.count(".") + 2)}
    found: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = {alias.name: {alias.name} for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            subs = {f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known}
            targets = {base: subs | ({base} if len(subs) < len(node.names) else set())}
        else:
            continue
        for statement, modules in targets.items():
            run = set()
            for module in modules:
                parts = module.split(".")
                run |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)} - inside
            found.setdefault(statement, set()).update(run)
    return found


def graph() -> dict[str, set[str]]:
    """Module -> the modules importing it makes Python run (of replicadp_tasks/ and client/, and the others)."""
    mods = modules()
    return {name: set().union(*imports_of(name, path, set(mods)).values()) for name, path in mods.items()}


def statements() -> dict[str, set[str]]:
    """Module -> the module paths its import statements name."""
    mods = modules()
    return {name: set(imports_of(name, path, set(mods))) for name, path in mods.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, or of one that imports itself (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in edges:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges.get(v, ()):
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def room_of(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "replicadp_tasks" and parts[1] in ROOMS else None


def test_no_import_circle():
    """No module of replicadp_tasks/ or client/ reaches itself through its imports, a function-level import
    counted like any other (a circle hidden inside a function breaks as soon as that import moves to the top)."""
    assert cycles(graph()) == []


def test_a_circle_put_back_is_found():
    """The check finds a circle: the graph with one import added back (settings importing the contract's request
    module, which the webhook form check would make settings' own importer) reports it."""
    edges = graph()
    edges["replicadp_tasks.contract.request"] = edges["replicadp_tasks.contract.request"] | {"replicadp_tasks.settings"}
    assert any("replicadp_tasks.settings" in c and "replicadp_tasks.contract.request" in c for c in cycles(edges))


def test_rooms_import_one_way():
    """Each room imports only the rooms below it (MAY_IMPORT), and never the modules at the top (settings aside,
    which the non-pure rooms read): app, tasks and worker import the rooms, never the reverse."""
    wrong = []
    for name, imported in graph().items():
        room = room_of(name)
        if room is None:
            continue
        for other in imported:
            target = room_of(other)
            if target not in (None, room) and target not in MAY_IMPORT[room]:
                wrong.append(f"{name} -> {other}")
            if other in ("replicadp_tasks.app", "replicadp_tasks.tasks", "replicadp_tasks.worker") or \
                    other.startswith("client"):
                wrong.append(f"{name} -> {other}")
    assert wrong == []


def test_the_pure_rooms_import_no_celery_redis_or_settings():
    """contract/ and model/ import neither Celery (nor kombu, billiard), nor redis, nor replicadp's settings;
    cluster/ neither Celery nor the settings."""
    wrong = [f"{name} -> {other}" for name, imported in graph().items() if room_of(name) in FORBIDDEN
             for other in imported
             if any(other == bad or other.startswith(bad + ".") for bad in FORBIDDEN[room_of(name)])]
    assert wrong == []


def test_client_reaches_the_worker_side_through_the_faces():
    """client/ imports replicadp_tasks, a room (replicadp_tasks.<room>) or a top module (app, settings, logs), never
    a module inside a room."""
    wrong = [f"{name} -> {other}" for name, imported in statements().items() if name.startswith("client")
             for other in imported if other.startswith("replicadp_tasks")
             and other not in TOP and not (room_of(other) and other.count(".") == 1)]
    assert wrong == []


def test_each_module_of_the_pure_rooms_imports_on_its_own():
    """Every module of contract/ and model/ imports first in an interpreter (each after the package's modules are
    forgotten), and so does settings: no module depends on another having been imported before it."""
    names = [n for n in modules() if room_of(n) in ("contract", "model")] + ["replicadp_tasks.settings"]
    code = ("import importlib, json, sys\n"
            "failed = {}\n"
            "for name in json.loads(sys.argv[1]):\n"
            "    for m in [m for m in sys.modules if m.startswith('replicadp_tasks')]:\n"
            "        del sys.modules[m]\n"
            "    try:\n"
            "        importlib.import_module(name)\n"
            "    except Exception as exc:\n"
            "        failed[name] = repr(exc)\n"
            "print(json.dumps(failed))\n")
    run = subprocess.run([sys.executable, "-c", code, json.dumps(names)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout) == {}
