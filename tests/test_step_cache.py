"""The fast path: step caching and quantization as served options, checked at load; `quality` per request, in the
input's identity; the cache state reset for every request; and the isolation protocol with standard and fast
requests interleaved, through real replicas."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import AVX2
from test_isolation import protocol

from replicadp_tasks.contract import (Accepts, InvalidRequest, ModelLoadError, RequestCancelled, input_key,
                                      validate_request)
from replicadp_tasks.model import CacheMethod, ModelOptions, PipelineHolder, Quantize, StepCache, mag_ratios_file
from replicadp_tasks.model.step_cache import count_block_work

ROOT = Path(__file__).resolve().parent.parent
REPLICADP = str(Path(sys.executable).parent / "replicadp")
# 8 steps: enough for every method to skip some work on the tiny model (4 leave MagCache nothing to skip).
REQUEST = {"prompt": "a red fox in snow", "seed": 1, "height": 64, "width": 64, "num_frames": 9,
           "num_inference_steps": 8}
# Each method with a knob at which it skips work on the tiny model (FirstBlockCache's default 0.05 skips nothing).
KNOBS = {CacheMethod.FIRST_BLOCK: {"threshold": 0.2}, CacheMethod.MAG: {}, CacheMethod.TAYLORSEER: {"interval": 2},
         CacheMethod.PAB: {}}


def req(quality: str = "standard", **changes):
    return validate_request({**REQUEST, "quality": quality, **changes})


@pytest.fixture(scope="module")
def mag_ratios(tiny_model, tmp_path_factory) -> Path:
    """MagCache ratios for the tiny model, written by `replicadp calibrate-mag` (the command operators run)."""
    out = tmp_path_factory.mktemp("mag") / "tiny.json"
    run = subprocess.run([REPLICADP, "calibrate-mag", "--model", "tiny", "--size", "64x64", "--num-frames", "9",
                          "--steps", "8", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    saved = json.loads(out.read_text())
    assert saved["model"] == "tiny" and len(saved["mag_ratios"]) == 8 and saved["mag_ratios"][0] == 1.0
    return out


def holder(tiny_model, method=CacheMethod.NONE, mag_ratios=None, **options) -> PipelineHolder:
    cache = StepCache.of(method, mag_ratios_path=mag_ratios, model="tiny", **KNOBS.get(method, {}))
    h = PipelineHolder(ModelOptions("tiny", model_cache=tiny_model.parent, cache=cache, **options))
    h.load()
    return h


def test_settings_are_checked_at_load_naming_the_setting_and_the_choices(tiny_model, tmp_path):
    """A bad cache method or quantization stops the process at start-up naming the variable and the choices; a
    knob the method does not take, one out of range, missing or foreign MagCache ratios, FP8 without a GPU that
    has it, and a cache with compilation each fail the load with a message that names the setting."""
    for name, value, choices in (("REPLICADP_CACHE", "teacache", "none, first-block, mag, taylorseer, pab"),
                                 ("REPLICADP_QUANTIZE", "int4", "none, fp8")):
        run = subprocess.run([sys.executable, "-c", "import replicadp_tasks.settings"], cwd=ROOT, text=True,
                             capture_output=True, env={**os.environ, name: value}, timeout=60)
        assert run.returncode != 0 and f"{name}='{value}' is not one of {choices}" in run.stderr, run.stderr
    cases = [
        (dict(method=CacheMethod.TAYLORSEER, threshold=0.1), "REPLICADP_CACHE_THRESHOLD=0.1: REPLICADP_CACHE=taylorseer takes no threshold"),
        (dict(method=CacheMethod.MAG, interval=3), "REPLICADP_CACHE_INTERVAL=3: REPLICADP_CACHE=mag takes no interval"),
        (dict(method=CacheMethod.FIRST_BLOCK, threshold=1.5), "REPLICADP_CACHE_THRESHOLD=1.5: expected a number in (0, 1]"),
        (dict(method=CacheMethod.PAB, interval=0), "REPLICADP_CACHE_INTERVAL=0: expected an integer from 1 to 50"),
        (dict(method=CacheMethod.MAG, mag_ratios_path=tmp_path / "none.json", model="tiny"),
         "REPLICADP_CACHE=mag needs MagCache ratios calibrated on 'tiny'"),
        (dict(method=CacheMethod.MAG, mag_ratios_path=tmp_path / "none.json", model="tiny"),
         "run `replicadp calibrate-mag --model tiny` first"),
    ]
    (tmp_path / "other.json").write_text(json.dumps({"model": "other", "mag_ratios": [1.0, 0.9]}))
    cases.append((dict(method=CacheMethod.MAG, mag_ratios_path=tmp_path / "other.json", model="tiny"),
                  "calibrated on 'other', not on the served model 'tiny'"))
    for kwargs, message in cases:
        with pytest.raises(ModelLoadError) as err:
            StepCache.of(**kwargs)
        assert message in str(err.value)
    with pytest.raises(ModelLoadError, match=r"REPLICADP_QUANTIZE=fp8: needs a CUDA GPU of compute capability 8\.9 "
                                             r"or newer .* this replica runs on cpu"):
        holder(tiny_model, quantize=Quantize.FP8)
    with pytest.raises(ModelLoadError, match="REPLICADP_CACHE=pab cannot be combined with REPLICADP_COMPILE=blocks"):
        holder(tiny_model, CacheMethod.PAB, compile="blocks")


def test_quality_is_validated_and_part_of_the_identity(tiny_model, mag_ratios):
    """`quality` is standard or fast, and fast only where the replica has a step cache (InvalidRequest names the
    field); the two paths of one input have different identities, and so do fast paths with other caches."""
    with pytest.raises(InvalidRequest, match="quality='hd': must be one of standard, fast"):
        req("hd")
    plain, cached = holder(tiny_model), holder(tiny_model, CacheMethod.MAG, mag_ratios)
    assert plain.qualities == ["standard"] and cached.qualities == ["standard", "fast"]
    with pytest.raises(InvalidRequest, match="quality='fast': not served here"):
        validate_request({**REQUEST, "quality": "fast"}, Accepts(qualities=tuple(plain.qualities)))
    assert validate_request({**REQUEST, "quality": "fast"}, Accepts(qualities=tuple(cached.qualities))).quality == "fast"
    pab = holder(tiny_model, CacheMethod.PAB)
    keys = {input_key(req(q).params(), "tiny", h.served(req(q)))
            for q, h in (("standard", plain), ("standard", cached), ("fast", cached), ("fast", pab))}
    assert len(keys) == 3  # the standard path is the same whatever cache the deployment has
    assert cached.served(req("fast")) == {"cache": "mag threshold=0.06"} and plain.served(req()) == {}


def interrupted(h: PipelineHolder, request) -> None:
    """Run `request` on `h` and stop it at its third step, as a cancelled request stops."""
    def cancel(step, total):
        if step == 3:
            raise RequestCancelled("stopped at step 3")
    with pytest.raises(RequestCancelled):
        h.generate(request, on_step=cancel)


@pytest.mark.parametrize("method", list(KNOBS))
def test_a_fast_requests_output_does_not_depend_on_what_ran_before(method, tiny_model, mag_ratios):
    """On one replica's pipeline, a fast request gives the same frames first, after another fast request (other
    prompt, seed and step count), after a fast request stopped half-way (cancelled: its cache state is left
    mid-request), and after a standard one; the fast path skips work (at KNOBS' knob it calls fewer of the
    transformer's blocks than the exact path, and its frames differ), and a standard request on a deployment
    with a cache gives the exact path's frames."""
    h = holder(tiny_model, method, mag_ratios)
    calls = count_block_work(h.pipe.transformer)
    first = h.generate(req("fast"))
    fast_work = calls["n"]
    h.generate(req("fast", prompt="a blue car at night", seed=9, num_inference_steps=6))
    after_fast = h.generate(req("fast"))
    interrupted(h, req("fast", prompt="a blue car at night", seed=9))
    after_cancelled = h.generate(req("fast"))
    before = calls["n"]
    standard = h.generate(req("standard"))
    standard_work = calls["n"] - before
    after_standard = h.generate(req("fast"))
    assert np.array_equal(first, after_fast) and np.array_equal(first, after_cancelled)
    assert np.array_equal(first, after_standard)
    assert fast_work < standard_work and not np.array_equal(first, standard)
    assert np.array_equal(standard, holder(tiny_model).generate(req("standard")))
    assert not h.pipe.transformer.is_cache_enabled  # nothing of the fast path stays installed between requests


def test_a_cache_left_installed_would_bleed(tiny_model, mag_ratios):
    """Why the hooks are installed per request: with diffusers' cache left on the transformer (enabled once), a
    request stopped half-way leaves its state behind and the next request's frames change. This is what the test
    above would catch if the fast path kept its cache between requests."""
    h = holder(tiny_model)
    h.pipe.transformer.enable_cache(StepCache.of(CacheMethod.MAG, mag_ratios_path=mag_ratios, model="tiny")
                                    .config(8, lambda: h.pipe.current_timestep))
    try:
        clean = h.generate(req())
        interrupted(h, req(prompt="a blue car at night", seed=9))
        assert not np.array_equal(clean, h.generate(req()))
    finally:
        h.pipe.transformer.disable_cache()


def test_calibrate_mag_writes_where_replicas_read(tiny_model, tmp_path):
    """Without --out, `calibrate-mag` writes the model cache's file for the model, the file a replica of that
    model reads when REPLICADP_MAG_RATIOS is unset; the ratios are the exact path's (the same on a rerun)."""
    env = {**os.environ, "REPLICADP_MODEL_CACHE": str(tiny_model.parent)}
    env.pop("REPLICADP_MAG_RATIOS", None)
    runs = []
    for _ in range(2):
        run = subprocess.run([REPLICADP, "calibrate-mag", "--model", "tiny", "--size", "64x64", "--num-frames", "9",
                              "--steps", "6", "--prompts", "1"], capture_output=True, text=True, timeout=300, env=env)
        assert run.returncode == 0, run.stdout + run.stderr
        runs.append(json.loads(mag_ratios_file(tiny_model.parent, "tiny").read_text()))
    assert runs[0]["mag_ratios"] == runs[1]["mag_ratios"] and len(runs[0]["mag_ratios"]) == 6
    assert str(mag_ratios_file(tiny_model.parent, "tiny")) in " ".join(run.stdout.split())
    assert StepCache.of(CacheMethod.MAG, mag_ratios_path=mag_ratios_file(tiny_model.parent, "tiny"),
                        model="tiny").mag_ratios == tuple(runs[0]["mag_ratios"])


@pytest.mark.parametrize("isa", ["native", "avx2"])
def test_isolation_protocol_with_standard_and_fast_interleaved(isa, redis_db, tiny_model, mag_ratios, tmp_path):
    """The isolation protocol with MagCache on: 16 distinct inputs, standard and fast in turn, made by one replica
    one at a time (the baseline), then by two other replica processes at concurrency 4: all 16 match bit for bit,
    both replicas take part, and each result says which path ran. On the machine's own instruction set and with
    AVX2 forced (test_isolation.py's reason). The fast path the replicas served really skips work: here, the same
    cache on one of their fast inputs calls fewer of the transformer's blocks than the exact path, and its frames
    differ (MagCache picks the steps it skips from its ratios, threshold and step count alone, not from the input
    nor the instruction set)."""
    env = {"OUTPUT_DIR": str(tmp_path / "out"), "REPLICADP_CACHE": "mag", "REPLICADP_MAG_RATIOS": str(mag_ratios),
           **(AVX2 if isa == "avx2" else {})}
    protocol(redis_db(), f"step-cache-{isa}", tmp_path, env, "--steps", "8", "--quality", "mixed")
    stored = [json.loads(p.read_text()) for p in (tmp_path / "out").glob("*.json")]  # the output store's Results
    assert len(stored) == 16 + 4 + 16  # the baseline's requests, the check's warm-ups (its concurrency) and its own
    assert sorted(r["params"]["quality"] for r in stored) == ["fast"] * 18 + ["standard"] * 18
    h = holder(tiny_model, CacheMethod.MAG, mag_ratios)
    fast_req = validate_request({"prompt": "x", "quality": "fast"}, Accepts(qualities=tuple(h.qualities)))
    assert {r["params"]["quality"]: r["served"] for r in stored} == {"standard": {}, "fast": h.served(fast_req)}
    fast = next(r["params"] for r in stored if r["params"]["quality"] == "fast")
    calls = count_block_work(h.pipe.transformer)
    exact = h.generate(req("standard", prompt=fast["prompt"], seed=fast["seed"]))
    exact_work = calls["n"]
    cached = h.generate(req("fast", prompt=fast["prompt"], seed=fast["seed"]))
    assert calls["n"] - exact_work < exact_work and not np.array_equal(exact, cached)
