"""LoRA adapters (REPLICADP_LORAS): a deployment registers them, each request picks its own and their scales.

The deployment names its adapters in a TOML file, one table each:

    [adapters.style]
    source = "loras/style.safetensors"      # a local file (relative: to this file), or hf://owner/repo/path/file
    scale = 0.8                             # what a request that names it without a scale gets (1.0)
    experts = ["transformer"]               # the transformers it is loaded into (every one of the model's)

A replica loads every adapter once, at start, into its experts (diffusers' WanLoraLoaderMixin, through peft), with
its SHA-256; one that cannot be read or does not fit the model stops the start, named. Then every adapter is
switched off. A request runs with exactly the adapters and scales it names (`activate`), applied in the order of
their names, and every adapter is switched off again after it (`deactivate`), also when it failed or was
cancelled: a switched-off LoRA layer computes its base layer alone, so a request without adapters gets the frames
of a model that never had any. No request can name a path or a URL: only a registered name.

Imports no Celery; torch, diffusers and peft are imported inside the functions.
"""

from __future__ import annotations

import hashlib
import tomllib
from dataclasses import dataclass
from pathlib import Path

from ..contract.errors import ModelLoadError
from ..contract.request import LORA_NAME_RE, MAX_SCALE, is_scale

HUB_PREFIX = "hf://"
EXPERTS = ("transformer", "transformer_2")


@dataclass(frozen=True)
class Adapter:
    """A registered adapter as a replica loaded it."""

    name: str
    source: str  # as registered: a local path or hf://...
    scale: float  # the default scale
    experts: tuple[str, ...]  # where it is loaded
    sha256: str  # of the file loaded

    def info(self) -> dict:
        """What crosses the wire (ReplicaInfo.loras)."""
        return {"name": self.name, "source": self.source, "scale": self.scale, "experts": list(self.experts),
                "sha256": self.sha256}


@dataclass(frozen=True)
class Registration:
    """One table of the registry file, checked, not yet loaded."""

    name: str
    source: str
    scale: float
    experts: tuple[str, ...] | None  # None: every expert of the model


def read_registry(path: str | None) -> list[Registration]:
    """REPLICADP_LORAS's file, checked: ModelLoadError naming the setting, the adapter and the key that is wrong."""
    if not path:
        return []
    where = f"REPLICADP_LORAS={path!r}"
    try:
        tables = tomllib.loads(Path(path).read_text()).get("adapters", {})
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{where}: cannot read it: {exc}") from exc
    if not isinstance(tables, dict) or not tables:
        raise ModelLoadError(f"{where}: no [adapters.NAME] table")
    out = []
    for name, table in tables.items():
        at = f"{where}: adapter {name!r}"
        if not LORA_NAME_RE.fullmatch(name):
            raise ModelLoadError(f"{at}: a name is 1-64 of a-z, 0-9, '_', '.', '-', starting with a letter or digit")
        if not isinstance(table, dict) or set(table) - {"source", "scale", "experts"}:
            raise ModelLoadError(f"{at}: expected the keys source, scale, experts; got {sorted(table)}")
        source = table.get("source")
        if not isinstance(source, str) or not source:
            raise ModelLoadError(f"{at}: source must be a file's path or hf://owner/repo/file")
        scale = table.get("scale", 1.0)
        if not is_scale(scale):
            raise ModelLoadError(f"{at}: scale={scale!r} must be a number from -{MAX_SCALE:g} to {MAX_SCALE:g}")
        experts = table.get("experts")
        if experts is not None and (not isinstance(experts, list) or not experts or
                                    any(e not in EXPERTS for e in experts) or len(set(experts)) != len(experts)):
            raise ModelLoadError(f"{at}: experts={experts!r} must list some of {', '.join(EXPERTS)}")
        if not source.startswith(HUB_PREFIX):  # a relative path is the file's neighbour, wherever replicas run
            source = str(Path(path).expanduser().resolve().parent / Path(source).expanduser())
        out.append(Registration(name, source, float(scale), None if experts is None else tuple(experts)))
    return out


def _local_file(reg: Registration) -> Path:
    """The adapter's file: the local path, or the hub file downloaded (into the hub cache, once)."""
    if not reg.source.startswith(HUB_PREFIX):
        return Path(reg.source).expanduser()
    from huggingface_hub import hf_hub_download

    owner, _, rest = reg.source[len(HUB_PREFIX):].partition("/")
    repo, _, filename = rest.partition("/")
    if not (owner and repo and filename):
        raise ValueError("expected hf://owner/repo/path/to/file.safetensors")
    return Path(hf_hub_download(f"{owner}/{repo}", filename))


def load(pipe, registrations: list[Registration]) -> list[Adapter]:
    """Load every registered adapter into its experts, then switch all of them off. ModelLoadError naming the
    adapter where one cannot be read or does not fit the model."""
    names = [name for name in EXPERTS if getattr(pipe, name, None) is not None]
    adapters = []
    for reg in registrations:
        at = f"REPLICADP_LORAS: adapter {reg.name!r} ({reg.source})"
        experts = reg.experts or tuple(names)
        missing = [e for e in experts if e not in names]
        if missing:
            raise ModelLoadError(f"{at}: experts={list(experts)}: this model has no {', '.join(missing)}")
        try:
            path = _local_file(reg)
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            for expert in experts:
                pipe.load_lora_weights(str(path), adapter_name=reg.name,
                                       load_into_transformer_2=expert == "transformer_2")
        except Exception as exc:  # a missing file, a hub error, a checkpoint of another model's shapes
            raise ModelLoadError(f"{at}: cannot load it: {type(exc).__name__}: {str(exc)[:400]}") from exc
        adapters.append(Adapter(reg.name, reg.source, reg.scale, experts, digest))
    deactivate(pipe)
    return adapters


def activate(pipe, loras: tuple[tuple[str, float], ...]) -> None:
    """Exactly `loras` (name, scale) on, in the order given (by name: validate.check_loras), on each expert that
    has them; every other adapter off."""
    deactivate(pipe)
    for expert in _adapted(pipe):
        mine = [(name, scale) for name, scale in loras if name in expert.peft_config]
        if mine:
            expert.enable_lora()
            expert.set_adapters([name for name, _ in mine], [scale for _, scale in mine])


def deactivate(pipe) -> None:
    """Every adapter off: each adapted layer computes its base layer alone."""
    for expert in _adapted(pipe):
        expert.disable_lora()


def _adapted(pipe) -> list:
    return [m for m in (getattr(pipe, name, None) for name in EXPERTS) if getattr(m, "peft_config", None)]
