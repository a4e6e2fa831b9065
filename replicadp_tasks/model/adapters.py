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

An adapter marked `fuse = true` is instead fused into the weights as the replica loads (diffusers' `fuse_lora`,
then its LoRA layers unloaded, before any other adapter loads): the replica then serves another model (its files'
SHA-256 are in every request's identity), on which compile, FP8, offloading and layouts work as on a checkpoint,
and no request can switch it off. A distilled (few-step) adapter brings its sampling recipe (contract/recipe.py):
fused, the recipe is the model's; switched per request, a request naming it samples with it. The two experts of
Wan2.2 A14B take a pair, one file each (Wan2.2 Lightning's high- and low-noise adapters):

    [adapters.lightning]
    source = { transformer = "high_noise.safetensors", transformer_2 = "low_noise.safetensors" }
    fuse = true
    recipe = { num_inference_steps = 4, guidance_scale = 1.0, scheduler = "flow-match-euler", shift = 5.0,
               timesteps = [1000, 750, 500, 250] }

diffusers converts the key layouts these projects publish (original Wan / LightX2V, musubi) as it loads them.

Imports no Celery; torch, diffusers and peft are imported inside the functions.
"""

from __future__ import annotations

import hashlib
import tomllib
from dataclasses import dataclass
from pathlib import Path

from ..contract.errors import ModelLoadError
from ..contract.recipe import Recipe, read_recipe
from ..contract.request import LORA_NAME_RE, MAX_SCALE, is_scale

HUB_PREFIX = "hf://"
EXPERTS = ("transformer", "transformer_2")


@dataclass(frozen=True)
class Adapter:
    """A registered adapter as a replica loaded it."""

    name: str
    source: str | dict[str, str]  # as registered: a local path or hf://..., or one per expert
    scale: float  # the default scale (fused: the scale it was fused at)
    experts: tuple[str, ...]  # where it is loaded
    sha256: str  # of the file loaded; of a pair, `expert:sha256` of each, joined by ","
    fused: bool = False  # fused into the weights at load: part of the model, not a request's choice
    recipe: Recipe | None = None  # a distilled adapter's sampling

    def info(self) -> dict:
        """What crosses the wire (ReplicaInfo.loras, ReplicaInfo.fused)."""
        return {"name": self.name, "source": self.source, "scale": self.scale, "experts": list(self.experts),
                "sha256": self.sha256, "recipe": None if self.recipe is None else self.recipe.to_wire()}


@dataclass(frozen=True)
class Registration:
    """One table of the registry file, checked, not yet loaded."""

    name: str
    source: str | dict[str, str]  # one file, or one per expert (a pair)
    scale: float
    experts: tuple[str, ...] | None  # None: every expert of the model (or, for a pair, the pair's)
    fuse: bool = False
    recipe: Recipe | None = None


KEYS = ("source", "scale", "experts", "fuse", "recipe")


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
    registrations = [_registration(name, table, f"{where}: adapter {name!r}", Path(path))
                     for name, table in tables.items()]
    recipes = [r.name for r in registrations if r.fuse and r.recipe is not None]
    if len(recipes) > 1:
        raise ModelLoadError(f"{where}: adapters {', '.join(map(repr, recipes))} are fused with a recipe each; a "
                             "model samples with one")
    return registrations


def _registration(name: str, table, at: str, registry: Path) -> Registration:
    if not LORA_NAME_RE.fullmatch(name):
        raise ModelLoadError(f"{at}: a name is 1-64 of a-z, 0-9, '_', '.', '-', starting with a letter or digit")
    if not isinstance(table, dict) or set(table) - set(KEYS):
        raise ModelLoadError(f"{at}: expected the keys {', '.join(KEYS)}; got {sorted(table)}")
    source, experts = table.get("source"), table.get("experts")
    if isinstance(source, dict):  # a pair: one file per expert
        if experts is not None or not source or set(source) - set(EXPERTS) or \
                not all(isinstance(s, str) and s for s in source.values()):
            raise ModelLoadError(f"{at}: source, as a table, gives a file for each of some of {', '.join(EXPERTS)} "
                                 "(and then no experts key)")
        source = {expert: _beside(file, registry) for expert, file in source.items()}
    elif isinstance(source, str) and source:
        source = _beside(source, registry)
    else:
        raise ModelLoadError(f"{at}: source must be a file's path or hf://owner/repo/file, or a table of one per "
                             "expert")
    scale = table.get("scale", 1.0)
    if not is_scale(scale):
        raise ModelLoadError(f"{at}: scale={scale!r} must be a number from -{MAX_SCALE:g} to {MAX_SCALE:g}")
    if experts is not None and (not isinstance(experts, list) or not experts or
                                any(e not in EXPERTS for e in experts) or len(set(experts)) != len(experts)):
        raise ModelLoadError(f"{at}: experts={experts!r} must list some of {', '.join(EXPERTS)}")
    fuse = table.get("fuse", False)
    if not isinstance(fuse, bool):
        raise ModelLoadError(f"{at}: fuse={fuse!r} must be true or false")
    recipe = None if table.get("recipe") is None else read_recipe(table["recipe"], f"{at}: recipe")
    return Registration(name, source, float(scale), None if experts is None else tuple(experts), fuse, recipe)


def _beside(source: str, registry: Path) -> str:
    """A relative path is the registry file's neighbour, wherever replicas run."""
    if source.startswith(HUB_PREFIX):
        return source
    return str(registry.expanduser().resolve().parent / Path(source).expanduser())


def switched(path: str | None) -> bool:
    """Whether REPLICADP_LORAS registers adapters that requests switch on and off (not only fused ones)."""
    return any(not r.fuse for r in read_registry(path))


def _local_file(source: str) -> Path:
    """The adapter's file: the local path, or the hub file downloaded (into the hub cache, once)."""
    if not source.startswith(HUB_PREFIX):
        return Path(source).expanduser()
    from huggingface_hub import hf_hub_download

    owner, _, rest = source[len(HUB_PREFIX):].partition("/")
    repo, _, filename = rest.partition("/")
    if not (owner and repo and filename):
        raise ValueError("expected hf://owner/repo/path/to/file.safetensors")
    return Path(hf_hub_download(f"{owner}/{repo}", filename))


def load(pipe, registrations: list[Registration]) -> list[Adapter]:
    """Fuse the adapters marked so into the weights, then load every other into its experts and switch all of
    them off. ModelLoadError naming the adapter where one cannot be read, does not fit the model or would fuse
    non-finite weights."""
    fused = [_load_one(pipe, reg) for reg in registrations if reg.fuse]
    for adapter in fused:
        try:
            pipe.fuse_lora(components=list(adapter.experts), lora_scale=adapter.scale, adapter_names=[adapter.name],
                           safe_fusing=True)
        except Exception as exc:  # safe_fusing: a NaN or infinite weight
            raise ModelLoadError(f"REPLICADP_LORAS: adapter {adapter.name!r}: cannot fuse it: "
                                 f"{type(exc).__name__}: {str(exc)[:400]}") from exc
    if fused:
        pipe.unload_lora_weights()  # the LoRA layers go; the fused weights stay
    switchable = [_load_one(pipe, reg) for reg in registrations if not reg.fuse]
    deactivate(pipe)
    return fused + switchable


def _load_one(pipe, reg: Registration) -> Adapter:
    """Load `reg`'s file(s) into its experts, under its name."""
    names = [name for name in EXPERTS if getattr(pipe, name, None) is not None]
    at = f"REPLICADP_LORAS: adapter {reg.name!r} ({reg.source})"
    files = reg.source if isinstance(reg.source, dict) else {e: reg.source for e in reg.experts or names}
    missing = [e for e in files if e not in names]
    if missing:
        raise ModelLoadError(f"{at}: experts={list(files)}: this model has no {', '.join(missing)}")
    digests = {}
    try:
        for expert, source in files.items():
            path = _local_file(source)
            digests[expert] = hashlib.sha256(path.read_bytes()).hexdigest()
            pipe.load_lora_weights(str(path), adapter_name=reg.name, load_into_transformer_2=expert == "transformer_2")
            if reg.name not in (getattr(getattr(pipe, expert), "peft_config", None) or {}):
                # diffusers warns, and loads nothing, where no key names a layer: an adapter that would do nothing
                raise ValueError(f"no key of {path.name} names a layer of {expert} (a key layout diffusers does not "
                                 "read, or another model's adapter)")
    except Exception as exc:  # a missing file, a hub error, a checkpoint of another model's shapes or layout
        raise ModelLoadError(f"{at}: cannot load it: {type(exc).__name__}: {str(exc)[:400]}") from exc
    digest = next(iter(digests.values())) if len(set(files.values())) == 1 else \
        ",".join(f"{expert}:{sha}" for expert, sha in digests.items())
    return Adapter(reg.name, reg.source, reg.scale, tuple(files), digest, reg.fuse, reg.recipe)


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
