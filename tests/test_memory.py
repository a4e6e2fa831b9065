"""The memory options (REPLICADP_OFFLOAD, memory.py): what each keeps on the GPU, from the real models' module
trees (the tiny stand-ins, and the full-size A14B built on the meta device); the check at load that refuses an
option the device cannot hold, naming the setting, the need, the device's memory and the options that fit; the
combinations refused; and that no option changes a request's frames (the real diffusers pipelines, no Celery).
Then `replicadp up` refusing a deployment whose weights exceed REPLICADP_DEVICE_MEMORY_GIB. Replicas that serve
with the options run in test_experts.py (its `served` fixture).

On a CPU replica the options' moves go from the CPU to the CPU: these tests prove the bookkeeping, the hooks'
order and the outputs; what each option saves on a GPU is scripts/gpu_check.sh's memory step."""

import re
import subprocess

import numpy as np
import pytest
import torch
from PIL import Image

from helpers import holder
from test_embedded import started_with
from test_http import REPLICADP

from replicadp_tasks.contract import Accepts, ModelLoadError, validate_request
from replicadp_tasks.model import CacheMethod, Offload, PipelineHolder, Quantize, StepCache
from replicadp_tasks.model.architectures import architecture, build_components, build_tokenizer
from replicadp_tasks.model.memory import Devices, block_bytes, check, models_of, needs, weight_bytes
from replicadp_tasks.model.step_cache import count_block_work

REQUEST = {"prompt": "a lighthouse at dusk", "seed": 5, "height": 64, "width": 64, "num_frames": 5,
           "num_inference_steps": 6}
GIB = 2**30


def frames_of(h: PipelineHolder, image=None, **fields) -> np.ndarray:
    req = validate_request({**REQUEST, **fields}, Accepts(size_multiple=h.size_multiple, experts=h.expert_count,
                                                             qualities=tuple(h.qualities)))
    return h.generate(req, image=image)


def need_of(models: dict, offload: Offload) -> int:
    return needs(models, offload, Devices(["cuda:0"], [None], streamed=True))[0].total


def test_each_option_keeps_what_it_says_on_the_gpu(model_cache):
    """On the tiny two-expert stand-in: `none` needs every model, `expert` all but transformer_2, `model` the
    largest model alone, `group` the largest of each model's non-block weights plus two of its blocks (the one
    running and the one prefetched), a model that names its own block modules (the VAE) whole."""
    models = models_of(holder("tiny-a14b", model_cache).pipe)
    size = {name: weight_bytes(m) for name, m in models.items()}
    assert set(size) == {"text_encoder", "transformer", "transformer_2", "vae"}
    assert need_of(models, Offload.NONE) == sum(size.values())
    assert need_of(models, Offload.EXPERT) == sum(size.values()) - size["transformer_2"]
    assert need_of(models, Offload.MODEL) == max(size.values())
    outside, block = block_bytes(models["transformer"])
    assert outside > 0 and block > 0 and outside + 2 * block == size["transformer"]  # its 2 equal blocks
    assert block_bytes(models["vae"]) == (0, size["vae"])
    group = {n: (o + 2 * b if o else b) for n, (o, b) in ((n, block_bytes(m)) for n, m in models.items())}
    assert need_of(models, Offload.GROUP) == max(group.values())


def test_full_size_a14b_needs_per_option():
    """Wan2.2-T2V-A14B served in bf16 (VAE fp32), from its meta-device build: all resident 64.4 GiB (describe-model's
    64.3 is the parameters alone; the rope tables are buffers); the idle expert out 37.7; one model at a time 26.7; group offload 10.6: UMT5-xxl has no top-level block
    list, so diffusers moves it whole, and it outweighs a transformer's embeddings and two of its 40 blocks."""
    with torch.device("meta"):
        models = build_components(architecture("wan2.2-t2v-a14b"), build_tokenizer(), torch.bfloat16)
    got = {o: round(need_of(models, o) / GIB, 1) for o in Offload}
    assert got == {Offload.NONE: 64.4, Offload.EXPERT: 37.7, Offload.MODEL: 26.7, Offload.GROUP: 10.6}, got


def test_an_option_the_device_cannot_hold_is_refused_by_name(model_cache):
    """Each option, given one byte less than it needs, is refused at load with an error that names
    REPLICADP_OFFLOAD's value, the need (in total and by model), the device, what it has and where that figure
    came from, and the options that would fit; given exactly its need, it loads. With nothing that fits, the error
    says so."""
    models = models_of(holder("tiny-a14b", model_cache).pipe)
    for offload in Offload:
        need = need_of(models, offload)
        check(models, offload, Devices(["cuda:0"], [need], "free at load", streamed=True))
        with pytest.raises(ModelLoadError) as refused:
            check(models, offload, Devices(["cuda:0"], [need - 1], "free at load", streamed=True))
        message = str(refused.value)
        assert message.startswith(f"REPLICADP_OFFLOAD={offload}: the weights need {need / 2**20:.2f} MiB on cuda:0 (")
        assert f"and cuda:0 has {(need - 1) / 2**20:.2f} MiB (free at load)" in message
        smaller = [o for o in Offload if need_of(models, o) < need]
        for o in Offload:
            assert (f"REPLICADP_OFFLOAD={o} needs {need_of(models, o) / 2**20:.2f} MiB" in message) == (o in smaller)
        if not smaller:
            assert message.endswith("no memory option fits: use a larger GPU")
    with pytest.raises(ModelLoadError, match=r"the weights need 0\.37 MiB on cuda:0 \(text_encoder 0\.10 MiB \+ "
                                             r"transformer 0\.11 MiB \+ transformer_2 0\.11 MiB \+ vae 0\.05 MiB\)"):
        check(models, Offload.NONE, Devices(["cuda:0"], [1000], "free at load", streamed=True))


def test_options_that_cannot_serve_the_deployment_are_refused(model_cache):
    """At load, by name: `expert` on a one-transformer model; any offload on a replica of several GPUs; offload
    with an FP8 transformer or a compiled one (neither has run on offloaded weights); and on a two-expert model,
    MagCache (its ratios are calibrated on one transformer). REPLICADP_DEVICE_MEMORY_GIB on a CPU replica is checked
    against the estimate, and the error names the setting as the figure's source."""
    with pytest.raises(ModelLoadError, match=r"REPLICADP_OFFLOAD=expert: the model has one transformer"):
        holder("tiny", model_cache, offload=Offload.EXPERT)
    models = models_of(holder("tiny-a14b", model_cache).pipe)
    with pytest.raises(ModelLoadError, match=r"REPLICADP_OFFLOAD=model: offloading serves a replica of one GPU; "
                                             r"this one has 2 \(GPUS_PER_REPLICA\)"):
        check(models, Offload.MODEL, Devices(["cuda:0", "cuda:1"], [None, None], streamed=True))
    for options, setting in (({"quantize": Quantize.FP8}, "REPLICADP_QUANTIZE=fp8"),
                             ({"compile": "blocks"}, "REPLICADP_COMPILE=blocks")):
        with pytest.raises(ModelLoadError, match=f"REPLICADP_OFFLOAD=group cannot be combined with {setting}"):
            holder("tiny-a14b", model_cache, offload=Offload.GROUP, **options)
    with pytest.raises(ModelLoadError, match=r"REPLICADP_CACHE=mag: MagCache's ratios are calibrated on one "
                                             r"transformer, and 'tiny-a14b' has two experts"):
        holder("tiny-a14b", model_cache, cache=StepCache(CacheMethod.MAG, threshold=0.06, mag_ratios=(1.0, 1.0)))
    with pytest.raises(ModelLoadError, match=re.escape("and cpu has 0.10 MiB (REPLICADP_DEVICE_MEMORY_GIB=0.0001); "
                                                       "REPLICADP_OFFLOAD=group needs 0.10 MiB")):
        holder("tiny-a14b", model_cache, memory_gib=0.0001)
    assert holder("tiny-a14b", model_cache, offload=Offload.GROUP, memory_gib=0.0001).pipe is not None


def test_no_option_changes_the_frames(model_cache):
    """The same inputs give bit-identical frames with every option as with every model resident: on the two-expert
    stand-in (the expert swapped in at the boundary, and back at the next request's start: seed 5 again after 6),
    and on the TI2V one, with and without a first frame (its image-to-video view shares the offloaded models)."""
    image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (64, 64, 3), dtype=np.uint8))
    a14b = {o: holder("tiny-a14b", model_cache, offload=o) for o in Offload}
    want = {seed: frames_of(a14b[Offload.NONE], seed=seed) for seed in (5, 6)}
    assert not np.array_equal(want[5], want[6])
    for offload, h in a14b.items():
        for seed in (5, 6, 5):
            assert np.array_equal(frames_of(h, seed=seed), want[seed]), offload
    ti2v = {o: holder("tiny", model_cache, offload=o) for o in (Offload.NONE, Offload.MODEL, Offload.GROUP)}
    plain, with_image = frames_of(ti2v[Offload.NONE]), frames_of(ti2v[Offload.NONE], image)
    assert not np.array_equal(plain, with_image)
    for offload, h in ti2v.items():
        assert np.array_equal(frames_of(h), plain) and np.array_equal(frames_of(h, image), with_image), offload
        assert np.array_equal(frames_of(h), plain), offload


def test_the_fast_path_caches_both_experts(model_cache):
    """A fast request on the two-expert stand-in runs the step cache on each expert: with FirstBlockCache at its
    loosest threshold, each expert computes fewer blocks than on the exact path, and a standard request after it
    gives the exact frames again (no cache state outlives the request)."""
    h = holder("tiny-a14b", model_cache, cache=StepCache.of(CacheMethod.FIRST_BLOCK, threshold=1.0))
    calls = {name: count_block_work(getattr(h.pipe, name)) for name in ("transformer", "transformer_2")}

    def blocks(**fields):
        for c in calls.values():
            c["n"] = 0
        frames = frames_of(h, boundary_ratio=0.95, num_inference_steps=8, **fields)  # 4 steps each
        return frames, {name: c["n"] for name, c in calls.items()}

    exact, full = blocks()
    fast, cached = blocks(quality="fast")
    assert full == {"transformer": 48, "transformer_2": 48}  # 4 steps x 2 passes x 2 blocks x 3 parts each
    assert all(0 < cached[name] < full[name] for name in calls), (cached, full)
    assert not np.array_equal(fast, exact)
    again, _ = blocks()
    assert np.array_equal(again, exact)


@pytest.mark.cluster
def test_up_refuses_weights_past_the_device_memory_setting(clean_env, model_cache):
    """`replicadp up --model tiny-a14b` with REPLICADP_DEVICE_MEMORY_GIB below what every model resident needs
    ends at the replica's first exit (exit 1) with the replica's error, naming REPLICADP_OFFLOAD=none, the need,
    the setting, and the options that fit; nothing is left running."""
    env, tmp = clean_env
    env.update(REPLICADP_DEVICE_MEMORY_GIB="0.00015", CUDA_VISIBLE_DEVICES="")
    run = subprocess.run([REPLICADP, "up", "--threads", "1", "--model", "tiny-a14b"], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "a replica exited before it served" in run.stderr, run.stderr
    assert ("REPLICADP_OFFLOAD=none: the weights need 0.37 MiB on cpu (text_encoder 0.10 MiB + transformer 0.11 MiB "
            "+ transformer_2 0.11 MiB + vae 0.05 MiB), and cpu has 0.15 MiB (REPLICADP_DEVICE_MEMORY_GIB=0.00015); "
            "REPLICADP_OFFLOAD=model needs 0.11 MiB, REPLICADP_OFFLOAD=group needs 0.10 MiB") in run.stderr, run.stderr
    assert started_with(tmp) == set()
