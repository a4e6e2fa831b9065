"""Where a model comes from (REPLICADP_MODEL): a tiny stand-in built here, a local folder, a hub model (downloaded
first), a random-weight architecture (`random:ARCH`) or the benchmark-only synthetic backend (`synthetic:...`)."""

from __future__ import annotations

import json
from pathlib import Path

from ..contract.errors import ModelLoadError
from . import hub

TINY_SPECS = {"tiny": "wan2.2-ti2v", "tiny-wan2.1": "wan2.1-t2v", "tiny-a14b": "wan2.2-t2v-a14b",
              "tiny-i2v-a14b": "wan2.2-i2v-a14b"}
# The pipeline classes a model folder's model_index.json may name (`_class_name`).
PIPELINE_CLASSES = ("WanPipeline", "WanImageToVideoPipeline")
# `random:ARCH` builds architecture ARCH (architectures.py) with random weights on the replica's GPU: the full
# compute of a model whose weights cannot be downloaded here.
RANDOM_PREFIX = "random:"
# `synthetic:SECONDS` is a benchmark-only backend (synthetic.py): SECONDS per request of the reference size, scaled
# by work; `synthetic:SECONDS:DECODE` then spends DECODE seconds after its last step, as a pipeline decodes.
SYNTHETIC_PREFIX = "synthetic:"


def synthetic_seconds(spec: str) -> tuple[float, float] | None:
    """(SECONDS, DECODE) of a `synthetic:SECONDS[:DECODE]` spec (DECODE 0 when left out), or None for a real
    model."""
    if not spec.startswith(SYNTHETIC_PREFIX):
        return None
    parts = spec[len(SYNTHETIC_PREFIX):].split(":")
    try:
        seconds = [float(p) for p in parts] + [0.0] * (2 - len(parts))
    except ValueError:
        seconds = [-1.0]
    if len(seconds) != 2 or not all(0 <= s < 86400 for s in seconds):
        raise ModelLoadError(f"REPLICADP_MODEL={spec!r}: expected synthetic:SECONDS or synthetic:SECONDS:DECODE "
                             "with 0 <= each < 86400")
    return seconds[0], seconds[1]


def resolve_model(spec: str, model_cache: Path) -> str:
    """A model spec to the local folder from_pretrained loads: a hub model is downloaded first (hub.py)."""
    if spec in TINY_SPECS:
        from .tiny_model import ensure_tiny_model

        return str(ensure_tiny_model(model_cache / spec, TINY_SPECS[spec]))
    if Path(spec).expanduser().is_dir():
        return str(Path(spec).expanduser().resolve())
    if spec.startswith((".", "/", "~")):
        raise ModelLoadError(f"REPLICADP_MODEL={spec!r}: no such folder")
    return hub.download(spec)


def pipeline_class(folder: str):
    """The diffusers pipeline class that `folder`'s model_index.json names; ValueError for another one."""
    import diffusers

    name = json.loads((Path(folder) / "model_index.json").read_text()).get("_class_name")
    if name not in PIPELINE_CLASSES:
        raise ValueError(f"model_index.json names {name!r}; replicadp serves {', '.join(PIPELINE_CLASSES)}")
    return getattr(diffusers, name)
