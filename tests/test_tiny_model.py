import os

os.environ["HF_HUB_OFFLINE"] = "1"  # everything here must work with no model hub

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline, WanImageToVideoPipeline
from PIL import Image

from replicadp_tasks.model import tiny_model


def _frames(pipe, seed):
    # The image-to-video stand-in needs a first frame.
    image = {"image": Image.new("RGB", (64, 64), "red")} if isinstance(pipe, WanImageToVideoPipeline) else {}
    return pipe(
        prompt="a red fox", height=64, width=64, num_frames=9, num_inference_steps=2,
        generator=torch.Generator("cpu").manual_seed(seed), output_type="np", max_sequence_length=16, **image,
    ).frames


@pytest.mark.parametrize("variant", tiny_model.VARIANTS)
def test_round_trip_is_seed_deterministic(tmp_path, variant):
    """A saved tiny model loads with plain DiffusionPipeline.from_pretrained (the class its model_index.json names:
    WanPipeline, WanImageToVideoPipeline for the I2V A14B stand-in) and yields video frames that are bit-identical
    for the same seed and different for another seed."""
    directory = tiny_model.save_tiny_model(tmp_path / "model", variant)
    pipe = DiffusionPipeline.from_pretrained(directory)
    first, again, other = _frames(pipe, 7), _frames(pipe, 7), _frames(pipe, 8)
    assert first.shape == (1, 9, 64, 64, 3)
    assert np.array_equal(first, again)
    assert not np.array_equal(first, other)


def test_build_is_reproducible():
    """Two builds have identical weights, so every process that builds the model gets the same one."""
    a = tiny_model.build_tiny_pipeline().transformer.state_dict()
    b = tiny_model.build_tiny_pipeline().transformer.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_save_twice_keeps_first_copy(tmp_path):
    """A second save_tiny_model returns the same directory, leaves the first copy's files in place
    and leaves no temp directories behind."""
    directory = tiny_model.save_tiny_model(tmp_path / "model")
    index = directory / "model_index.json"
    inode = index.stat().st_ino
    assert tiny_model.save_tiny_model(tmp_path / "model") == directory
    assert index.stat().st_ino == inode
    assert os.listdir(tmp_path) == ["model"]


def test_save_loses_race_gracefully(tmp_path, monkeypatch):
    """If another process finishes saving while we build, we return its copy untouched and discard ours."""
    directory = tmp_path / "model"
    real_build = tiny_model.build_tiny_pipeline

    def build_while_another_process_wins(variant):
        pipe = real_build(variant)
        directory.mkdir()
        (directory / "model_index.json").write_text(json.dumps({"winner": True}))
        return pipe

    monkeypatch.setattr(tiny_model, "build_tiny_pipeline", build_while_another_process_wins)
    assert tiny_model.save_tiny_model(directory) == directory
    assert json.loads((directory / "model_index.json").read_text()) == {"winner": True}
    assert os.listdir(tmp_path) == ["model"]


def test_ensure_does_not_rebuild(tmp_path, monkeypatch):
    """ensure_tiny_model builds a missing model once, then returns the existing folder without building."""
    directory = tiny_model.ensure_tiny_model(tmp_path / "model")
    assert (directory / "model_index.json").exists()

    def fail(variant):
        raise AssertionError("rebuilt an existing model")

    monkeypatch.setattr(tiny_model, "build_tiny_pipeline", fail)
    assert tiny_model.ensure_tiny_model(tmp_path / "model") == directory


@pytest.mark.parametrize("func", [tiny_model.build_tiny_pipeline, tiny_model.save_tiny_model,
                                  tiny_model.ensure_tiny_model])
def test_unknown_variant_raises(tmp_path, func):
    """Every entry point rejects an unknown variant with a ValueError naming it, before touching disk."""
    args = () if func is tiny_model.build_tiny_pipeline else (tmp_path / "model",)
    with pytest.raises(ValueError, match="wan9-bogus"):
        func(*args, variant="wan9-bogus")
    assert not os.listdir(tmp_path)


def test_module_import_does_not_import_torch():
    """The module itself imports without torch, so a Celery parent process can import it cheaply."""
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('tiny_model', {tiny_model.__file__!r})\n"
        "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
        "assert not {'torch', 'diffusers', 'transformers'} & set(sys.modules), sorted(sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
