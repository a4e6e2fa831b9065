"""The GPU path's CPU-testable parts: architectures built from configs (random weights), their sizes and FLOPs,
the `random:` model spec, placement across devices, and the speed options. The pipeline holder alone, no Celery."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from diffusers import WanPipeline, WanTransformer3DModel
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from replicadp_tasks.contract import Accepts, ModelLoadError, validate_request
from replicadp_tasks.model import ModelOptions, PipelineHolder
from replicadp_tasks.model.architectures import ARCHITECTURES, build_pipeline, describe, dit_flops, reference_flops
from replicadp_tasks.model.memory import place

REQUEST = {"prompt": "a red fox in snow", "seed": 3, "height": 64, "width": 64, "num_frames": 5,
           "num_inference_steps": 3}


def counted_flops(name: str, device: str, frames=3, height=8, width=12, text_len=16) -> tuple[int, int]:
    """(FLOPs torch's FlopCounterMode counts in one transformer forward, dit_flops' figure) for one shape.
    SDPA's math backend: the CPU's fused attention kernel is not registered with the counter."""
    arch = ARCHITECTURES[name]
    cfg = arch.transformer
    with torch.device(device):
        model = WanTransformer3DModel(**cfg).eval()
    tokens = frames * (height // 2) * (width // 2)
    x = torch.randn(1, cfg["in_channels"], frames, height, width, device=device)
    timestep = torch.ones(1, tokens, dtype=torch.long, device=device) if arch.ti2v else \
        torch.ones(1, dtype=torch.long, device=device)
    text = torch.randn(1, text_len, cfg["text_dim"], device=device)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter, torch.inference_mode():
        model(hidden_states=x, timestep=timestep, encoder_hidden_states=text, return_dict=False)
    return counter.get_total_flops(), dit_flops(cfg, tokens, text_len, timestep_tokens=tokens if arch.ti2v else 1)


@pytest.mark.parametrize("name", ["tiny-wan2.2-ti2v", "tiny-wan2.1-t2v", "tiny-wan2.2-t2v-a14b",
                                  "tiny-wan2.2-i2v-a14b"])
def test_dit_flops_equal_a_real_forward_pass(name):
    """The FLOP formula behind MFU counts exactly the matrix products that a real forward pass runs (per-token
    timesteps for TI2V, one per sample for T2V and the A14B experts, 36 input channels for I2V)."""
    counted, formula = counted_flops(name, "cpu")
    assert counted == formula


@pytest.mark.parametrize("name", ["wan2.2-ti2v-5b", "wan2.1-t2v-1.3b", "wan2.1-t2v-14b", "wan2.2-i2v-a14b"])
def test_dit_flops_of_the_full_size_models(name):
    """The same on the full-size configs, run on the meta device (shapes only, nothing computed)."""
    counted, formula = counted_flops(name, "meta", frames=9, height=30, width=52, text_len=512)
    assert counted == formula


def test_full_size_models_weigh_what_the_published_checkpoints_do():
    """Built on the meta device, the configs give the published sizes: Wan2.2-TI2V-5B's transformer 5.0 B
    parameters (9.3 GiB in bf16), its VAE 0.7 B, UMT5-xxl 5.7 B; Wan2.1-T2V-1.3B's transformer 1.42 B."""
    five = {r["component"]: r for r in describe("wan2.2-ti2v-5b")}
    assert round(five["transformer"]["parameters"] / 1e9, 2) == 5.00
    assert round(five["transformer"]["bf16_bytes"] / 2**30, 1) == 9.3
    assert round(five["vae"]["parameters"] / 1e9, 1) == 0.7 and five["vae"]["served_dtype"] == "fp32"
    assert round(five["text_encoder"]["parameters"] / 1e9, 1) == 5.7
    small = {r["component"]: r for r in describe("wan2.1-t2v-1.3b")}
    assert round(small["transformer"]["parameters"] / 1e9, 2) == 1.42
    # The reference request (832x480, 33 frames, 30 steps, guidance): 3510 tokens, 2.2 PFLOP in the DiT.
    assert round(reference_flops("wan2.2-ti2v-5b") / 1e15, 2) == 2.21


def test_describe_model_command(tmp_path):
    """`replicadp describe-model` prints the table and writes JSON; an unknown spec is a usage error naming it."""
    out = tmp_path / "five.json"
    run = subprocess.run([sys.executable, "-c", "from client.cli import main; main()", "describe-model",
                          "random:wan2.2-ti2v-5b", "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "5.000 B" in run.stdout and "2.21 PFLOP" in run.stdout
    assert json.loads(out.read_text())["dit_flops"] == reference_flops("wan2.2-ti2v-5b")
    bad = subprocess.run([sys.executable, "-c", "from client.cli import main; main()", "describe-model",
                          "random:wan9"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "'random:wan9'" in bad.stderr and "wan2.2-ti2v-5b" in bad.stderr


def test_random_weights_are_cast_as_from_pretrained_casts_real_ones(tiny_model):
    """In bf16, as a GPU replica serves a model: `random:` builds keep in fp32 exactly the parameters that
    from_pretrained(dtype=bf16) keeps in fp32 when it loads a saved model (the transformer's norms and time
    embedding; none of UMT5's), and the VAE is fp32."""
    built = build_pipeline("tiny-wan2.2-ti2v", dtype=torch.bfloat16)
    loaded = WanPipeline.from_pretrained(tiny_model, dtype=torch.bfloat16)
    for name in ("transformer", "text_encoder"):
        want = {n: p.dtype for n, p in getattr(loaded, name).named_parameters()}
        assert {n: p.dtype for n, p in getattr(built, name).named_parameters()} == want
    assert {p.dtype for p in built.transformer.parameters()} == {torch.bfloat16, torch.float32}
    assert {p.dtype for p in built.vae.parameters()} == {torch.float32}


def holder(spec: str, tiny_model_cache, **options) -> PipelineHolder:
    h = PipelineHolder(ModelOptions(spec, model_cache=tiny_model_cache, **options))
    h.load()
    return h


@pytest.fixture(scope="module")
def tiny_model_cache(tiny_model):
    return tiny_model.parent


def frames_of(h: PipelineHolder) -> np.ndarray:
    req = validate_request(REQUEST, Accepts(size_multiple=h.size_multiple), max_prompt_chars=4000, max_work=10**12)
    return h.generate(req)


def test_random_spec_builds_the_same_model_in_every_process(tiny_model_cache):
    """`random:tiny-wan2.2-ti2v` builds the architecture in place, with seeded weights: it yields exactly the
    frames of the saved `tiny` model loaded with from_pretrained, so replicas of a random model agree (what the
    GPU isolation check relies on). It reports the request's cost."""
    built, loaded = holder("random:tiny-wan2.2-ti2v", tiny_model_cache), holder("tiny", tiny_model_cache)
    assert np.array_equal(frames_of(built), frames_of(loaded))
    stats = built.last_run
    assert stats.dit_s > 0 and stats.peak_memory_gib > 0
    assert stats.dit_flops == reference_flops("tiny-wan2.2-ti2v", height=64, width=64, num_frames=5, steps=3)


def test_components_placed_across_devices_give_the_same_frames(tiny_model_cache):
    """GPUS_PER_REPLICA's placement: each model behind an accelerate hook that moves its inputs to its device
    and its outputs back. Exercised with three 'cpu' devices: the pipeline runs through the hooks unchanged."""
    h = holder("tiny", tiny_model_cache)
    plain = frames_of(h)
    place(h.pipe, ["cpu", "cpu", "cpu"])
    assert all(hasattr(getattr(h.pipe, m), "_hf_hook") for m in ("text_encoder", "transformer", "vae"))
    assert np.array_equal(frames_of(h), plain)


@pytest.mark.parametrize("spec, options, message", [
    ("random:wan9", {}, "REPLICADP_MODEL='random:wan9'.*wan2.2-ti2v-5b"),
    pytest.param("random:wan2.2-ti2v-5b", {}, "REPLICADP_MODEL='random:wan2.2-ti2v-5b'.*built on a GPU",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a valid spec on a GPU")),
    ("tiny", {"attention": "warp-drive"}, "REPLICADP_ATTENTION='warp-drive'"),
    ("tiny", {"compile": "max"}, "REPLICADP_COMPILE='max'"),
])
def test_bad_model_settings_fail_the_load_naming_the_setting(tiny_model_cache, spec, options, message):
    """A replica with a bad model spec or speed option refuses to start, naming the setting and its value (a
    full-size random model on a CPU too: it would take 46 GB of fp32 weights before failing)."""
    with pytest.raises(ModelLoadError, match=message):
        holder(spec, tiny_model_cache, **options)


def test_compiled_blocks_serve_requests(tiny_model_cache):
    """REPLICADP_COMPILE=blocks compiles each transformer block with torch.compile and still serves: frames
    of the requested shape, close to the eager ones (compiled kernels may round differently)."""
    eager = frames_of(holder("tiny", tiny_model_cache))
    compiled = frames_of(holder("tiny", tiny_model_cache, compile="blocks"))
    assert compiled.shape == eager.shape
    assert np.abs(compiled.astype(int) - eager.astype(int)).max() <= 2
