"""Wan2.2's two-expert A14B models: the published configs of the 14B architectures, the tiny two-expert stand-ins
(built offline, saved and loaded with from_pretrained like the other tiny models), which expert runs which
denoising step, the boundary and the second guidance scale per request, the image-to-video stand-in's first frame,
and describe-model's figures per expert: the pipeline holder alone (real diffusers pipelines, no Celery); then
replicas of the stand-ins served through Python, HTTP and the CLI."""

import base64
import hashlib
import io
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers import WanImageToVideoPipeline, WanPipeline, WanTransformer3DModel
from PIL import Image

from client.bench.describe import figures
from conftest import run_client_on, start_replicas
from helpers import holder
from test_http import REPLICADP, gateway, post

from replicadp_tasks.model.architectures import ARCHITECTURES, architecture_of, describe, dit_flops, reference_flops
from replicadp_tasks.contract import InvalidRequest, ModelLoadError
from replicadp_tasks.model import PipelineHolder
from replicadp_tasks.model.memory import place
from replicadp_tasks.contract import validate_request
from replicadp_tasks.contract import Accepts

REQUEST = {"prompt": "a red fox in snow", "seed": 3, "height": 64, "width": 64, "num_frames": 5,
           "num_inference_steps": 4}
# The published numbers. Transformer: Wan-Video/Wan2.2 wan/configs/wan_t2v_A14B.py and wan_i2v_A14B.py (dim 5120,
# ffn_dim 13824, 40 heads, 40 layers, freq_dim 256; boundary, sample_shift, sample_guide_scale as (low, high)
# noise), the same dims in diffusers' scripts/convert_wan_to_diffusers.py ("Wan-T2V-14B", "Wan2.2-T2V-A14B",
# "Wan2.2-I2V-14B-720p": in_channels 16 / 36, out_channels 16, text_dim 4096, boundary_ratio 0.875 / 0.9).
# Wan2.1-T2V-14B: Wan-Video/Wan2.1 wan/configs/wan_t2v_14B.py, and its generate.py defaults (shift 5.0 for t2v,
# --sample_guide_scale 5.0).
PUBLISHED = {
    "wan2.1-t2v-14b": dict(in_channels=16, boundary_ratio=None, flow_shift=5.0, guidance=(5.0, None)),
    "wan2.2-t2v-a14b": dict(in_channels=16, boundary_ratio=0.875, flow_shift=12.0, guidance=(4.0, 3.0)),
    "wan2.2-i2v-a14b": dict(in_channels=36, boundary_ratio=0.900, flow_shift=5.0, guidance=(3.5, 3.5)),
}


@pytest.fixture(scope="module")
def t2v(model_cache):
    return holder("tiny-a14b", model_cache)


@pytest.fixture(scope="module")
def i2v(model_cache):
    return holder("tiny-i2v-a14b", model_cache)


def frames_of(h: PipelineHolder, image=None, **fields) -> np.ndarray:
    req = validate_request({**REQUEST, **fields}, Accepts(size_multiple=h.size_multiple), max_prompt_chars=4000,
                           max_work=10**12)
    return h.generate(req, image=image)


def first_frame(seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (64, 64, 3), dtype=np.uint8))


def expert_calls(h: PipelineHolder, image=None, **fields) -> list[tuple[str, int]]:
    """(expert, timestep) of every transformer forward pass of one request, from forward hooks on both experts."""
    calls, hooks = [], []
    for name in ("transformer", "transformer_2"):
        def record(module, args, kwargs, output, name=name):
            calls.append((name, int(kwargs["timestep"].flatten()[0])))
        hooks.append(getattr(h.pipe, name).register_forward_hook(record, with_kwargs=True))
    try:
        frames_of(h, image, **fields)
    finally:
        for hook in hooks:
            hook.remove()
    return calls


@pytest.mark.parametrize("name", PUBLISHED)
def test_full_size_configs_are_the_published_ones(name):
    """The 14B architectures carry the published numbers: 40 heads x 128 = 5120 wide, ffn 13824, 40 layers,
    freq_dim 256, text_dim 4096, Wan2.1's 16-channel VAE (base_dim 96), in_channels 16 for T2V and 36 for I2V
    (16 noise + 4 mask + 16 image latents), and the boundary, shift and guidance of Wan's own configs."""
    arch, want = ARCHITECTURES[name], PUBLISHED[name]
    t = arch.transformer
    assert (t["num_attention_heads"] * t["attention_head_dim"], t["num_attention_heads"]) == (5120, 40)
    assert (t["ffn_dim"], t["num_layers"], t["freq_dim"], t["text_dim"]) == (13824, 40, 256, 4096)
    assert (t["in_channels"], t["out_channels"], tuple(t["patch_size"])) == (want["in_channels"], 16, (1, 2, 2))
    assert (arch.vae["z_dim"], arch.vae["base_dim"]) == (16, 96)
    assert (arch.boundary_ratio, arch.flow_shift) == (want["boundary_ratio"], want["flow_shift"])
    assert (arch.guidance_scale, arch.guidance_scale_2) == want["guidance"]
    assert arch.experts == (("transformer",) if want["boundary_ratio"] is None else ("transformer", "transformer_2"))
    assert not arch.ti2v and arch.i2v == (want["in_channels"] == 36)


def test_stand_ins_load_as_two_differently_seeded_experts(t2v, i2v):
    """The saved stand-ins load with from_pretrained into the class their model_index.json names, with both
    experts (their weights differ) and the boundary; the T2V one takes no image, the I2V one requires it."""
    for h, cls, boundary in ((t2v, WanPipeline, 0.875), (i2v, WanImageToVideoPipeline, 0.9)):
        assert type(h.pipe) is cls and h.boundary_ratio == boundary
        a, b = h.pipe.transformer.state_dict(), h.pipe.transformer_2.state_dict()
        assert a.keys() == b.keys() and not all(torch.equal(a[k], b[k]) for k in a)
    assert (t2v.accepts_image, t2v.requires_image) == (False, False)
    assert (i2v.accepts_image, i2v.requires_image) == (True, True)
    assert i2v.pipe.image_encoder is None  # Wan2.2 I2V has no CLIP image encoder


@pytest.mark.parametrize("spec", ["t2v", "i2v"])
def test_each_step_runs_the_expert_its_timestep_picks(request, spec):
    """Steps whose timestep is >= boundary_ratio x 1000 run on `transformer` (two passes each: guidance), the rest
    on `transformer_2`; both run in 4 steps; and the FLOPs the holder reports are each expert's passes times the
    formula's per-pass figure."""
    h = request.getfixturevalue(spec)
    calls = expert_calls(h, first_frame(0) if h.requires_image else None)
    scheduler = type(h.pipe.scheduler).from_config(h.pipe.scheduler.config)  # the pipeline's own is left alone
    scheduler.set_timesteps(REQUEST["num_inference_steps"])
    boundary = h.boundary_ratio * scheduler.config.num_train_timesteps
    want = [("transformer" if t >= boundary else "transformer_2", int(t)) for t in scheduler.timesteps for _ in (1, 2)]
    assert calls == want
    assert {name for name, _ in calls} == {"transformer", "transformer_2"}
    req = validate_request(REQUEST, Accepts(size_multiple=h.size_multiple))
    tokens = 2 * (64 // 8 // 2) ** 2  # 5 frames -> 2 latent frames of 4 x 4 patches
    per_pass = dit_flops(h.pipe.transformer.config, tokens, req.max_sequence_length)
    assert h.expert_flops(req) == {name: per_pass * sum(1 for n, _ in calls if n == name)
                                   for name in ("transformer", "transformer_2")}
    arch = "tiny-wan2.2-i2v-a14b" if h.requires_image else "tiny-wan2.2-t2v-a14b"
    assert h.last_run.dit_flops == h.dit_flops(req) == reference_flops(arch, height=64, width=64, num_frames=5,
                                                                       steps=4)


def test_a_requests_boundary_decides_its_frames_and_no_other(t2v):
    """A request's boundary_ratio moves the switch for that request alone: at 0.95 the step at timestep 923 runs on
    `transformer_2` too (4 passes there, not 2), its frames differ from the model's own boundary's (0.875) and are
    the same twice; at 0 every step runs on `transformer`. After each, the pipeline keeps the model's boundary: a
    request without one gives the first request's bytes again."""
    before = frames_of(t2v)
    assert np.array_equal(frames_of(t2v), before)
    moved = frames_of(t2v, boundary_ratio=0.95)
    assert [n for n, _ in expert_calls(t2v, boundary_ratio=0.95)].count("transformer_2") == 4  # 923 and 800, twice
    assert np.array_equal(frames_of(t2v, boundary_ratio=0.95), moved) and not np.array_equal(moved, before)
    assert {n for n, _ in expert_calls(t2v, boundary_ratio=0.0)} == {"transformer"}
    assert t2v.boundary_ratio == 0.875
    assert np.array_equal(frames_of(t2v), before)


def test_guidance_scale_2_guides_the_low_noise_expert(t2v):
    """guidance_scale_2 is the low-noise expert's guidance: unset it is guidance_scale's (5.0 given explicitly:
    the same bytes as unset), another value changes the frames."""
    unset = frames_of(t2v)
    assert np.array_equal(frames_of(t2v, guidance_scale_2=5.0), unset)
    assert not np.array_equal(frames_of(t2v, guidance_scale_2=2.0), unset)


def test_a_request_without_guidance_gets_the_models_own(t2v, i2v, model_cache):
    """What a request leaves out of the guidance is the model's published default, found from the loaded folder's
    transformer config, boundary and pipeline class: T2V-A14B's 4.0 and 3.0 (tiny-a14b), I2V-A14B's 3.5 and 3.5, a
    one-expert model's 5.0 alone; a field the request gives wins, the other keeps the model's. The defaults make
    the frames the same values given make. Every architecture is told apart by its transformer config alone."""
    assert t2v.request_defaults == {"guidance_scale": 4.0, "guidance_scale_2": 3.0}
    assert i2v.request_defaults == {"guidance_scale": 3.5, "guidance_scale_2": 3.5}
    assert holder("tiny", model_cache).request_defaults == {"guidance_scale": 5.0}
    req = validate_request(REQUEST, Accepts(defaults=t2v.request_defaults))
    assert (req.guidance_scale, req.guidance_scale_2) == (4.0, 3.0)
    given = validate_request({**REQUEST, "guidance_scale": 6.0}, Accepts(defaults=t2v.request_defaults))
    assert (given.guidance_scale, given.guidance_scale_2) == (6.0, 3.0)
    assert np.array_equal(t2v.generate(req), frames_of(t2v, guidance_scale=4.0, guidance_scale_2=3.0))
    assert not np.array_equal(t2v.generate(req), frames_of(t2v))  # validate.DEFAULTS' 5.0 for both
    for name, arch in ARCHITECTURES.items():
        with torch.device("meta"):
            config = WanTransformer3DModel(**arch.transformer).config
        assert architecture_of(config, arch.boundary_ratio, arch.i2v) == name


def test_two_expert_fields_are_checked_and_refused_by_one_expert_models():
    """guidance_scale_2 (0-20) and boundary_ratio (0-1) are validated naming the field and the value; a model of one
    expert (experts=1) refuses each by name; unset, neither is part of a request's params (the identity of a
    request that does not use them is what it was before they existed), set, both are."""
    for field, bad in (("guidance_scale_2", -1), ("guidance_scale_2", 20.5), ("guidance_scale_2", "2"),
                       ("guidance_scale_2", float("nan")), ("boundary_ratio", -0.1), ("boundary_ratio", 1.5),
                       ("boundary_ratio", True)):
        with pytest.raises(InvalidRequest) as refused:
            validate_request({**REQUEST, field: bad}, Accepts(experts=2))
        assert refused.value.field == field and f"{field}=" in str(refused.value)
    for field in ("guidance_scale_2", "boundary_ratio"):
        with pytest.raises(InvalidRequest, match="this model has one expert") as refused:
            validate_request({**REQUEST, field: 0.5}, Accepts(experts=1))
        assert refused.value.field == field
    plain = validate_request(REQUEST, Accepts(experts=1)).params()
    assert not {"guidance_scale_2", "boundary_ratio"} & set(plain)
    both = validate_request({**REQUEST, "guidance_scale_2": 3, "boundary_ratio": 0.5}, Accepts(experts=None)).params()
    assert (both["guidance_scale_2"], both["boundary_ratio"]) == (3.0, 0.5)


def test_image_to_video_takes_the_first_frame(i2v):
    """The I2V stand-in's output depends on the first frame (the same one twice: the same bytes); a request with
    none is refused naming `image`."""
    a = frames_of(i2v, first_frame(1))
    assert np.array_equal(frames_of(i2v, first_frame(1)), a)
    assert not np.array_equal(frames_of(i2v, first_frame(2)), a)
    with pytest.raises(InvalidRequest, match="image-to-video") as refused:
        frames_of(i2v)
    assert refused.value.field == "image"


@pytest.mark.parametrize("spec, saved", [("random:tiny-wan2.2-t2v-a14b", "t2v"),
                                         ("random:tiny-wan2.2-i2v-a14b", "i2v")])
def test_random_spec_builds_the_saved_stand_in(request, model_cache, spec, saved):
    """`random:tiny-wan2.2-t2v-a14b` builds the same two experts as the saved `tiny-a14b` (and the I2V one as
    `tiny-i2v-a14b`): the same frames."""
    built, loaded = holder(spec, model_cache), request.getfixturevalue(saved)
    image = first_frame(3) if loaded.requires_image else None
    assert type(built.pipe) is type(loaded.pipe) and built.boundary_ratio == loaded.boundary_ratio
    assert np.array_equal(frames_of(built, image), frames_of(loaded, image))


def test_both_experts_placed_together_across_devices(model_cache):
    """GPUS_PER_REPLICA: `transformer_2` goes where `transformer` is, behind its own hook; the frames are those of
    one device (three 'cpu' devices here)."""
    h = holder("tiny-a14b", model_cache)
    plain = frames_of(h)
    place(h.pipe, ["cpu", "cpu", "cpu"])
    assert all(hasattr(getattr(h.pipe, m), "_hf_hook") for m in ("text_encoder", "transformer", "transformer_2", "vae"))
    assert np.array_equal(frames_of(h), plain)


def test_a_folder_of_another_pipeline_class_is_refused(tmp_path, model_cache):
    """A model folder whose model_index.json names a class replicadp does not serve fails the load, naming it."""
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    with pytest.raises(ModelLoadError, match="FluxPipeline"):
        holder(str(tmp_path), model_cache)


def test_describe_lists_both_experts():
    """Wan2.2-T2V-A14B on the meta device: two experts of 14,288,491,584 parameters each (the published "14B"
    per expert; 26.6 GiB each in bf16), UMT5-xxl 5.68 B, Wan2.1's VAE 0.127 B; I2V's experts 409,600 more
    (20 more input channels x 2 x 2 x 5120)."""
    rows = {r["component"]: r for r in describe("wan2.2-t2v-a14b")}
    assert list(rows) == ["text_encoder", "transformer", "transformer_2", "vae"]
    assert rows["transformer"]["parameters"] == rows["transformer_2"]["parameters"] == 14_288_491_584
    assert round(rows["transformer"]["bf16_bytes"] / 2**30, 1) == 26.6
    assert round(rows["text_encoder"]["parameters"] / 1e9, 2) == 5.68
    assert round(rows["vae"]["parameters"] / 1e9, 3) == 0.127
    i2v = {r["component"]: r for r in describe("wan2.2-i2v-a14b")}
    assert i2v["transformer_2"]["parameters"] - rows["transformer_2"]["parameters"] == 20 * 4 * 5120
    assert [r["component"] for r in describe("wan2.1-t2v-14b")] == ["text_encoder", "transformer", "vae"]


def test_describe_model_json_gives_each_experts_flops():
    """`describe-model random:wan2.2-t2v-a14b --json -`: both experts' parameters, each expert's steps and FLOPs
    at the reference workload (30 steps at shift 12: 19 at or above the 0.875 boundary, 11 below; 19.20 and
    11.12 PFLOP), their sum as `dit_flops`, and the weights' fit on one 139 GiB GPU (64.3 GiB), all resident and
    with each memory option (test_memory's figures); with --gpu-memory-gib 40 only the offloading ones fit, and on
    two GPUs only `none` serves."""
    run = subprocess.run([sys.executable, "-c", "from client.cli import main; main()", "describe-model",
                          "random:wan2.2-t2v-a14b", "--json", "-"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    fig = json.loads(run.stdout)
    assert [r["component"] for r in fig["components"]] == ["text_encoder", "transformer", "transformer_2", "vae"]
    experts = fig["experts"]
    assert {k: e["steps"] for k, e in experts.items()} == {"transformer": 19, "transformer_2": 11}
    assert [round(e["dit_flops"] / 1e15, 2) for e in experts.values()] == [19.20, 11.12]
    assert fig["dit_flops"] == sum(e["dit_flops"] for e in experts.values()) == reference_flops("wan2.2-t2v-a14b")
    assert fig["boundary_ratio"] == 0.875
    assert fig["memory"]["fits"] and round(fig["memory"]["weights_bytes_per_gpu"][0] / 2**30, 1) == 64.3
    assert "transformer_2: 11 steps, 11.12 PFLOP" in run.stderr and "fits" in run.stderr
    assert {o["offload"]: round(o["weights_bytes"] / 2**30, 1) for o in fig["offload"]} == {
        "none": 64.4, "expert": 37.7, "model": 26.7, "group": 10.6}
    small = figures("wan2.2-t2v-a14b", width=832, height=480, num_frames=33, steps=30, peak_tflops=989,
                    gpu_memory_gib=40)
    assert {o["offload"]: o["fits"] for o in small["offload"]} == {"none": False, "expert": True, "model": True,
                                                                   "group": True}
    assert "REPLICADP_OFFLOAD=model: 26.67 GiB at most on a GPU: fits" in run.stderr
    two = figures("wan2.2-t2v-a14b", width=832, height=480, num_frames=33, steps=30, peak_tflops=989, gpus=2)
    assert [o["offload"] for o in two["offload"] if o["unusable"] is None] == ["none"]


# --- served: replicas of the stand-ins, through Python, HTTP and the CLI ------------------------------------------

@pytest.fixture(scope="module")
def served(redis_db, model_cache):
    """A replica of each stand-in, each on a database of its own and with a memory option (memory.py):
    `tiny-a14b` (T2V) keeping its idle expert in CPU memory, within a device memory setting that both experts
    resident would exceed (0.31 MiB, against 0.37), and `tiny-i2v-a14b` (I2V) with group offload."""
    urls = SimpleNamespace(t2v=redis_db(), i2v=redis_db())
    groups = [start_replicas(1, urls.t2v, "a14b", model="tiny-a14b", REPLICADP_OFFLOAD="expert",
                             REPLICADP_DEVICE_MEMORY_GIB="0.0003"),
              start_replicas(1, urls.i2v, "i2v-a14b", model="tiny-i2v-a14b", REPLICADP_OFFLOAD="group")]
    try:
        yield urls
    finally:
        for group in groups:
            group.stop()


@pytest.mark.cluster
def test_a14b_replicas_serve_the_two_expert_fields_through_python_http_and_the_cli(served):
    """A tiny-a14b replica serves guidance_scale_2 and boundary_ratio from generate's kwargs (Python), the HTTP
    form and `replicadp generate --guidance-2 --boundary`: each reported in the Result's params; the same inputs
    give the same video by every route, other fields another one; a request without them gets the model's
    guidance for each expert; the gateway refuses a boundary_ratio out of range (400 naming it). `replicadp
    status` shows the replica's memory option."""
    two = {"guidance_scale_2": 2.0, "boundary_ratio": 0.5}
    python = run_client_on(served.t2v, [{**REQUEST, **two}, REQUEST], concurrency=2)
    assert all(o.ok for o in python), [o.error for o in python]
    assert {k: python[0].result["params"][k] for k in two} == two
    plain = python[1].result["params"]  # the model's guidance for each expert, its boundary
    assert (plain["guidance_scale"], plain["guidance_scale_2"]) == (4.0, 3.0) and "boundary_ratio" not in plain
    assert python[0].result["video_sha256"] != python[1].result["video_sha256"]
    form = {"prompt": REQUEST["prompt"], "seed": "3", "size": "64x64", "num_frames": "5", "num_inference_steps": "4",
            "guidance_scale_2": "2", "boundary_ratio": "0.5"}
    with gateway(served.t2v, "a14b") as gw:
        answer = post(gw, "/v1/videos/sync", form)
        assert answer.status_code == 200, answer.text
        assert hashlib.sha256(answer.content).hexdigest() == python[0].result["video_sha256"]
        refused = post(gw, "/v1/videos/sync", {**form, "boundary_ratio": "1.5"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "boundary_ratio", refused.text
    run = subprocess.run([REPLICADP, "generate", REQUEST["prompt"], "--seed", "3", "--size", "64x64", "--num-frames",
                          "5", "--steps", "4", "--guidance-2", "2", "--boundary", "0.5", "--json"],
                         env={**os.environ, "REDIS_URL": served.t2v}, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert {k: result["params"][k] for k in two} == two and result["video_sha256"] == python[0].result["video_sha256"]
    run = subprocess.run([REPLICADP, "status", "--json"], env={**os.environ, "REDIS_URL": served.t2v},
                         capture_output=True, text=True, timeout=60)
    assert [r["offload"] for r in json.loads(run.stdout)["replicas"]] == ["expert"], run.stdout + run.stderr


@pytest.mark.cluster
def test_an_i2v_a14b_replica_wants_its_first_frame(served):
    """A tiny-i2v-a14b replica refuses a request without an image, naming `image`, and serves one with a first
    frame (base64 PNG), whose identity carries the image's hash. In front of it, the gateway (400 naming its form
    field, input_reference) and `replicadp generate` (exit 2, naming --image) refuse an image-less request before
    it is queued."""
    png = base64.b64encode(first_frame_png()).decode()
    without, with_image = run_client_on(served.i2v, [REQUEST, {**REQUEST, "image": png}], concurrency=2)
    assert not without.ok and without.error == ("InvalidRequest: image: this model is image-to-video and needs a "
                                                "first frame"), without.error
    assert with_image.ok, with_image.error
    assert with_image.result["params"]["image_sha256"]
    with gateway(served.i2v, "i2v-a14b") as gw:
        refused = post(gw, "/v1/videos", {"prompt": "x", "size": "64x64", "num_frames": "5"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "input_reference", refused.text
    run = subprocess.run([REPLICADP, "generate", "x", "--size", "64x64", "--num-frames", "5", "--steps", "2"],
                         env={**os.environ, "REDIS_URL": served.i2v}, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--image" in run.stderr and "image-to-video" in run.stderr, run.stderr


@pytest.mark.cluster
def test_one_expert_replicas_refuse_the_two_expert_fields_by_name(replicas, redis_server):
    """Before anything is queued, in front of the session's one-expert replicas (tiny): the gateway answers 400
    naming boundary_ratio, and `replicadp generate --guidance-2` is a usage error naming its option (exit 2)."""
    form = {"prompt": "x", "size": "64x64", "num_frames": "5", "num_inference_steps": "2"}
    with gateway(redis_server.url, "one-expert") as gw:
        refused = post(gw, "/v1/videos", {**form, "boundary_ratio": "0.5"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "boundary_ratio", refused.text
    assert "this model has one expert" in refused.json()["error"]["message"]
    run = subprocess.run([REPLICADP, "generate", "x", "--size", "64x64", "--num-frames", "5", "--steps", "2",
                          "--guidance-2", "2"], env={**os.environ, "REDIS_URL": redis_server.url},
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--guidance-2" in run.stderr and "one expert" in run.stderr, run.stderr


def first_frame_png() -> bytes:
    buf = io.BytesIO()
    first_frame(4).save(buf, format="PNG")
    return buf.getvalue()
