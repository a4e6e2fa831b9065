"""Few-step serving (issue #57): sampling recipes (contract/recipe.py) and adapters fused at load (model/adapters.py).
The recipe as written and as a request meets it; tiny distilled adapters in LightX2V's key layout (a pair for
tiny-a14b), fused and switched per request, giving the same frames within a measured PSNR; the recipe's steps,
guidance and timesteps seen by the transformer itself; compile and layouts on a fused model, FP8 refused on a CPU
for the CPU's sake alone; the adapters and recipes a replica refuses to start with; then a stack serving `tiny`
beside its fused few-step variant `tiny-turbo`, through Python, the CLI and HTTP, and the isolation protocol on
the fused model."""

import hashlib
import json
import os
import subprocess

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import run_client_on, start_replicas
from helpers import holder
from test_http import REPLICADP, gateway, post
from test_isolation import protocol
from test_layouts import layout_frames

from client.bench.isolation import psnr_db
from replicadp_tasks.contract import (Accepts, InvalidRequest, ModelLoadError, Recipe, Scheduler, parse_recipe,
                                      read_recipe, validate_request)
from replicadp_tasks.model import TURBO_RECIPE, ModelOptions, PipelineHolder, read_registry, save_tiny_turbo
from replicadp_tasks.model.pipeline import experts

REQUEST = {"prompt": "a fox, quickly", "seed": 11, "height": 64, "width": 64, "num_frames": 5}
FOUR_STEPS = parse_recipe(TURBO_RECIPE, "TURBO_RECIPE")
# FUSED_PSNR_DB: fusing folds B·A into the weight where the switched-on adapter adds x·Aᵀ·Bᵀ after it: float sums
# in another order. Measured on this machine: 93.0 dB on tiny (one uint8 level off in a few pixels) and equal
# frames on tiny-a14b; the bound leaves room for another CPU's rounding, far above what any adapter changes
# (the plain model's frames are 30-45 dB away).
FUSED_PSNR_DB = 60.0


def shifted(timesteps, shift: float) -> list[float]:
    """The timesteps the transformer sees for a recipe's: each noise level t/1000 shifted as flow matching shifts
    it, times 1000 (LightX2V's step-distill scheduler)."""
    return [1000 * shift * (t / 1000) / (1 + (shift - 1) * (t / 1000)) for t in timesteps]


def test_a_recipe_is_checked_where_it_is_written(tmp_path):
    """A recipe (a TOML inline table) and a registry's few-step keys: each mistake names where and what; a good
    one reads back, a pair of files one per expert, fused."""
    assert FOUR_STEPS == Recipe(4, 1.0, None, Scheduler.FLOW_MATCH_EULER, 5.0, (1000, 750, 500, 250), True)
    assert read_recipe({"timesteps": [900, 300], "scheduler": "flow-match-euler"}, "x").num_inference_steps == 2
    for text, error in (("{steps = 4}", "a recipe is a table of num_inference_steps"),
                        ("{num_inference_steps = 0}", "num_inference_steps=0 must be an integer from 1 to 200"),
                        ("{num_inference_steps = 4, guidance_scale = 30}", "guidance_scale=30 must be a number"),
                        ("{num_inference_steps = 4, scheduler = 'ddim'}", "scheduler='ddim' must be one of model"),
                        ('{scheduler = "flow-match-euler", timesteps = [250, 500]}', "must be decreasing integers"),
                        ('{num_inference_steps = 3, scheduler = "flow-match-euler", timesteps = [900, 500]}',
                         "num_inference_steps=3 but 2 timesteps"),
                        ("{num_inference_steps = 4, timesteps = [900, 500, 300, 100]}", "taken by scheduler"),
                        ("{num_inference_steps = 4, shift = 5.0}", "shift needs a scheduler other than"),
                        ("{num_inference_steps = 4, strict = 1}", "strict=1 must be true or false"),
                        ("num_inference_steps = 4", "not a TOML inline table")):
        with pytest.raises(ModelLoadError, match=f"^REPLICADP_RECIPE: .*{error}"):
            parse_recipe(text, "REPLICADP_RECIPE")
    registry = tmp_path / "loras.toml"
    for text, error in (('source = "a"\nfuse = "yes"', "fuse='yes' must be true or false"),
                        ('source = { vae = "a" }', "source, as a table, gives a file for each of some of"),
                        ('source = { transformer = "a" }\nexperts = ["transformer"]', "and then no experts key"),
                        ('source = "a"\nrecipe = { steps = 4 }', "recipe: a recipe is a table")):
        registry.write_text(f"[adapters.turbo]\n{text}\n")
        with pytest.raises(ModelLoadError, match=f"REPLICADP_LORAS='.*': adapter 'turbo'.*{error}"):
            read_registry(str(registry))
    registry.write_text(f"[adapters.a]\nsource = 'a'\nfuse = true\nrecipe = {TURBO_RECIPE}\n"
                        f"[adapters.b]\nsource = 'b'\nfuse = true\nrecipe = {TURBO_RECIPE}\n")
    with pytest.raises(ModelLoadError, match="adapters 'a', 'b' are fused with a recipe each"):
        read_registry(str(registry))
    registry.write_text("[adapters.turbo]\nsource = { transformer = 'hi.st', transformer_2 = 'lo.st' }\n"
                        "fuse = true\n"
                        f"recipe = {TURBO_RECIPE}\n")
    (reg,) = read_registry(str(registry))
    assert (reg.fuse, reg.recipe, reg.experts) == (True, FOUR_STEPS, None)
    assert reg.source == {"transformer": str(tmp_path / "hi.st"), "transformer_2": str(tmp_path / "lo.st")}


def test_a_request_gets_the_recipe_by_default_and_is_refused_what_it_cannot_do():
    """A request to a few-step model leaves its steps and guidance to the recipe; another step count or guidance
    is refused naming the field (strict; on a two-expert model, the low-noise expert's guidance too, which the
    recipe sets as well), another guidance allowed where the recipe is not strict but never
    another count than its fixed timesteps; an adapter's recipe applies to the requests naming it, and a request
    with two recipes (the model's and an adapter's) is refused naming `loras`."""
    turbo = Accepts(recipe=FOUR_STEPS)
    req = validate_request(REQUEST, turbo)
    assert (req.num_inference_steps, req.guidance_scale) == (4, 1.0)
    assert validate_request({**REQUEST, "num_inference_steps": 4, "guidance_scale": 1}, turbo) == req
    for field, value, error in (("num_inference_steps", 30, "samples at its recipe's 4 fixed timesteps"),
                                ("guidance_scale", 5.0, "is distilled to sample with guidance_scale=1")):
        with pytest.raises(InvalidRequest, match=f"^{field}={value}: this model {error}") as exc:
            validate_request({**REQUEST, field: value}, turbo)
        assert exc.value.field == field
    a14b = Accepts(recipe=FOUR_STEPS, experts=2, defaults={"guidance_scale": 4.0, "guidance_scale_2": 3.0})
    assert validate_request(REQUEST, a14b).guidance_scale_2 == 1.0  # both experts unguided, not the model's 3.0
    with pytest.raises(InvalidRequest, match="^guidance_scale_2=7.0: this model is distilled to sample with"):
        validate_request({**REQUEST, "guidance_scale_2": 7.0}, a14b)
    loose = Accepts(recipe=Recipe(4, 1.0, None, Scheduler.FLOW_MATCH_EULER, 5.0, (1000, 750, 500, 250), False))
    assert validate_request({**REQUEST, "guidance_scale": 3.0}, loose).guidance_scale == 3.0
    with pytest.raises(InvalidRequest, match="num_inference_steps=8: this model samples at its recipe's 4"):
        validate_request({**REQUEST, "num_inference_steps": 8}, loose)
    exact = Accepts(loras={"turbo": 1.0, "style": 0.8}, lora_recipes={"turbo": FOUR_STEPS})
    assert validate_request(REQUEST, exact).num_inference_steps == 30
    assert validate_request({**REQUEST, "loras": [{"name": "turbo"}]}, exact).num_inference_steps == 4
    with pytest.raises(InvalidRequest, match="num_inference_steps=30: adapter 'turbo' samples at its recipe's"):
        validate_request({**REQUEST, "loras": [{"name": "turbo"}], "num_inference_steps": 30}, exact)
    both = Accepts(loras={"turbo": 1.0}, lora_recipes={"turbo": FOUR_STEPS}, recipe=FOUR_STEPS)
    with pytest.raises(InvalidRequest, match="^loras=.*this model and adapter 'turbo' each bring a sampling recipe"):
        validate_request({**REQUEST, "loras": [{"name": "turbo"}]}, both)


def test_describe_model_gives_a_recipe_s_flops_beside_the_exact_path_s(tmp_path):
    """`replicadp describe-model` on Wan2.2-TI2V-5B at the reference size: the 4-step no-CFG recipe (--recipe) runs
    8 passes where the exact path runs 60, 15x fewer transformer FLOPs (JSON and table); an adapter's recipe in
    REPLICADP_LORAS is listed too, fused, and a recipe that is wrong is an error naming it."""
    registry = tmp_path / "loras.toml"
    registry.write_text(f'[adapters.turbo]\nsource = "turbo.safetensors"\nfuse = true\nrecipe = {TURBO_RECIPE}\n')

    def describe(*args, **env):
        return subprocess.run([REPLICADP, "describe-model", "random:wan2.2-ti2v-5b", *args], capture_output=True,
                              text=True, timeout=120, env={**os.environ, **env})

    run = describe("--recipe", TURBO_RECIPE, "--json", "-", REPLICADP_LORAS=str(registry))
    fig = json.loads(run.stdout)
    given, fused = fig["recipes"]
    assert (given["of"], fused["of"]) == ("REPLICADP_RECIPE", "adapter 'turbo' (fused)")
    assert given["experts"]["transformer"]["steps"] == 4 and not given["guidance"]
    assert given["speedup"] == fused["speedup"] == 15.0 and given["dit_flops"] * 15 == fig["dit_flops"]
    assert "few-step recipe of REPLICADP_RECIPE (4 steps, guidance 1, flow-match-euler shift 5, timesteps " \
           "1000/750/500/250): 0.147 PFLOP per request, 15x fewer than the exact path's" in run.stderr, run.stderr
    bad = describe("--recipe", "{num_inference_steps = 400}")
    assert bad.returncode == 1 and "REPLICADP_RECIPE='{num_inference_steps = 400}': num_inference_steps=400" in \
        bad.stderr, bad.stderr


@pytest.fixture(scope="module", params=["tiny", "tiny-a14b"])
def kits(request, model_cache, tmp_path_factory):
    """For `tiny` and `tiny-a14b`: the few-step kit (`replicadp make-tiny-turbo`: LightX2V-layout adapters, a pair
    for the two experts), and three holders: the fused few-step model, the exact model with the adapter
    switched per request, and the plain model."""
    spec = request.param
    registries = save_tiny_turbo(model_cache / spec, tmp_path_factory.mktemp(f"turbo-{spec}"), seed=3)
    return spec, registries, {"fused": holder(spec, model_cache, loras_file=str(registries["fused"])),
                              "switched": holder(spec, model_cache, loras_file=str(registries["adapters"])),
                              "plain": holder(spec, model_cache)}


def run(h: PipelineHolder, **fields) -> np.ndarray:
    return h.generate(validate_request({**REQUEST, **fields}, h.accepts))


def test_a_fused_adapter_gives_the_frames_of_the_same_adapter_switched_on(kits):
    """The fused model's frames equal the exact model's with the same adapter switched on, within FUSED_PSNR_DB,
    and differ from the plain model's; the fused model has no LoRA layer left; its identity (`served`) names the
    fused files' SHA-256 and the recipe, the switched one's the adapter's files and the same recipe."""
    spec, registries, h = kits
    fused, switched = run(h["fused"]), run(h["switched"], loras=[{"name": "turbo"}])
    plain = run(h["plain"], num_inference_steps=4, guidance_scale=1.0)
    assert psnr_db(fused, switched) >= FUSED_PSNR_DB, psnr_db(fused, switched)
    assert psnr_db(fused, plain) < 50, psnr_db(fused, plain)
    assert not any(getattr(e, "peft_config", None) for e in experts(h["fused"].pipe))
    files = sorted(registries["fused"].parent.glob("turbo-*.safetensors"))
    digests = [hashlib.sha256(f.read_bytes()).hexdigest() for f in files]
    sha = digests[0] if len(files) == 1 else ",".join(f"{f.stem[6:]}:{d}" for f, d in zip(files, digests))
    req = validate_request(REQUEST, h["fused"].accepts)
    assert h["fused"].served(req) == {"fused": {"turbo": sha}, "recipe": FOUR_STEPS.sampling()}
    named = validate_request({**REQUEST, "loras": [{"name": "turbo"}]}, h["switched"].accepts)
    assert h["switched"].served(named) == {"recipe": FOUR_STEPS.sampling(), "loras": {"turbo": sha}}
    assert spec == "tiny" or len(files) == 2


def test_the_recipe_is_what_the_transformer_sees(kits):
    """Recorded by a hook on each expert: the fused model runs 4 passes (guidance 1: no CFG), at the recipe's
    timesteps shifted as flow matching shifts them; so does a request naming the switched adapter on the exact
    model, whose next request without it runs its own 30 steps with CFG (60 passes) on the model's own scheduler
    again."""
    _, _, h = kits
    seen = []
    hooks = [e.register_forward_pre_hook(lambda m, args, kw: seen.append(float(kw["timestep"].flatten()[0])),
                                         with_kwargs=True)
             for name in ("fused", "switched") for e in experts(h[name].pipe)]
    try:
        expected = pytest.approx(shifted(FOUR_STEPS.timesteps, FOUR_STEPS.shift), rel=1e-5)
        run(h["fused"])
        assert seen == expected
        seen.clear()
        own = h["switched"].pipe.scheduler
        run(h["switched"], loras=[{"name": "turbo"}])
        assert seen == expected
        seen.clear()
        run(h["switched"])
        assert len(seen) == 60 and h["switched"].pipe.scheduler is own
    finally:
        for hook in hooks:
            hook.remove()


def test_compile_takes_a_fused_model_and_fp8_is_refused_for_the_cpu_alone(tiny_model, tmp_path):
    """REPLICADP_COMPILE=blocks serves the fused model (within 2 levels of its eager frames: compiled kernels
    round otherwise), which a switched adapter is refused with; REPLICADP_QUANTIZE=fp8 on a fused model is refused
    because this replica has no GPU, and not because of the adapter."""
    registries = save_tiny_turbo(tiny_model, tmp_path, seed=3)
    fused = holder("tiny", tiny_model.parent, loras_file=str(registries["fused"]))
    compiled = holder("tiny", tiny_model.parent, loras_file=str(registries["fused"]), compile="blocks")
    assert np.abs(run(compiled).astype(int) - run(fused).astype(int)).max() <= 2
    with pytest.raises(ModelLoadError, match="REPLICADP_LORAS cannot be combined with REPLICADP_COMPILE=blocks"):
        holder("tiny", tiny_model.parent, loras_file=str(registries["adapters"]), compile="blocks")
    with pytest.raises(ModelLoadError, match="^REPLICADP_QUANTIZE=fp8: needs a CUDA GPU"):
        holder("tiny", tiny_model.parent, loras_file=str(registries["fused"]), quantize="fp8")


@pytest.mark.cluster
@pytest.mark.parametrize("spec, layout", [("tiny", "ulysses:2"), ("tiny-a14b", "cfg:2")])
def test_layouts_over_several_ranks_take_a_fused_model(model_cache, tmp_path, spec, layout):
    """The fused model under a layout over two ranks (each rank fuses the adapter as it loads: a pair into the two
    experts of tiny-a14b) gives one process's frames bit for bit, guided and unguided (test_layouts.layout_frames)."""
    env = {"REPLICADP_LORAS": str(save_tiny_turbo(model_cache / spec, tmp_path / "kit", seed=3)["fused"])}
    one, _ = layout_frames(spec, "none", tmp_path / "none", **env)
    frames, _ = layout_frames(spec, layout, tmp_path / layout.replace(":", ""), **env)
    assert all(np.array_equal(mine, theirs) for mine, theirs in zip(frames, one)), layout


def test_an_adapter_or_recipe_that_cannot_serve_stops_the_replica_naming_it(tiny_model, tmp_path):
    """At load, each named: a fused adapter whose file is missing, one of another model's shapes, one whose
    weights are not finite (fused safely), a recipe given both by REPLICADP_RECIPE and a fused adapter, and a
    recipe with guidance_scale_2 for a model of one expert."""
    registries = save_tiny_turbo(tiny_model, tmp_path, seed=4)
    good = load_file(tmp_path / "turbo-transformer.safetensors")
    down = next(k for k in good if k.endswith("lora_down.weight"))
    save_file({**good, down: torch.zeros(good[down].shape[0], good[down].shape[1] + 8)},
              tmp_path / "shapes.safetensors")
    save_file({**good, down: torch.full_like(good[down], float("nan"))}, tmp_path / "nan.safetensors")
    for source, error in (("none.safetensors", "cannot load it: .*No such file"),
                          ("shapes.safetensors", "cannot load it: .*size"),
                          ("nan.safetensors", "cannot fuse it: .*NaN")):
        path = tmp_path / f"{source}.toml"
        path.write_text(f'[adapters.bad]\nsource = "{source}"\nfuse = true\n')
        with pytest.raises(ModelLoadError, match=f"(?s)REPLICADP_LORAS: adapter 'bad'.*{error}"):
            PipelineHolder(ModelOptions("tiny", model_cache=tiny_model.parent, loras_file=str(path))).load()
    with pytest.raises(ModelLoadError, match="REPLICADP_RECIPE=.* cannot be combined with REPLICADP_LORAS's adapter "
                                             "'turbo', fused with a recipe of its own"):
        PipelineHolder(ModelOptions("tiny", model_cache=tiny_model.parent, loras_file=str(registries["fused"]),
                                    recipe="{num_inference_steps = 8}")).load()
    with pytest.raises(ModelLoadError, match="REPLICADP_RECIPE: guidance_scale_2 is for two-expert models"):
        PipelineHolder(ModelOptions("tiny", model_cache=tiny_model.parent,
                                    recipe="{num_inference_steps = 4, guidance_scale_2 = 1.0}")).load()


@pytest.mark.cluster
def test_a_stack_serves_a_model_beside_its_fused_few_step_variant(redis_db, tiny_model, tmp_path):
    """`tiny` (the adapter registered to switch per request) and `tiny-turbo` (fused) on one Redis: a request for
    tiny-turbo gets the recipe (4 steps, guidance 1) and the same video through Python, `replicadp generate` and
    HTTP; one for `tiny` naming the adapter samples with the same recipe on the exact model's replica; `tiny`
    alone keeps its own 30 steps; 30 steps for tiny-turbo are refused naming the field by the CLI (usage error)
    and the gateway (400); /v1/models shows tiny-turbo's fused adapter and recipe."""
    url = redis_db()
    registries = save_tiny_turbo(tiny_model, tmp_path / "kit", seed=5)
    exact = start_replicas(1, url, "fewstep-exact", REPLICADP_LORAS=str(registries["adapters"]),
                           OUTPUT_DIR=str(tmp_path))
    env = {**os.environ, "REDIS_URL": url}
    try:
        turbo = start_replicas(1, url, "fewstep-turbo", first=1, REPLICADP_LORAS=str(registries["fused"]),
                               REPLICADP_SERVED_MODEL_NAME="tiny-turbo", OUTPUT_DIR=str(tmp_path))
        try:
            fast, named, slow = run_client_on(url, [{**REQUEST, "model": "tiny-turbo"},
                                                    {**REQUEST, "model": "tiny", "loras": [{"name": "turbo"}]},
                                                    {**REQUEST, "model": "tiny"}], concurrency=3, timeout=120)
            cli = subprocess.run([REPLICADP, "generate", REQUEST["prompt"], "--seed", "11", "--size", "64x64",
                                  "--num-frames", "5", "--model", "tiny-turbo", "--json"], env=env,
                                 capture_output=True, text=True, timeout=120)
            bad_cli = subprocess.run([REPLICADP, "generate", "x", "--model", "tiny-turbo", "--steps", "30"], env=env,
                                     capture_output=True, text=True, timeout=60)
            form = {"prompt": REQUEST["prompt"], "seed": "11", "size": "64x64", "num_frames": "5",
                    "model": "tiny-turbo"}
            with gateway(url, "fewstep") as gw:
                models = {m["id"]: m for m in gw.client.get("/v1/models").json()["data"]}
                http = post(gw, "/v1/videos/sync", form)
                bad_http = post(gw, "/v1/videos/sync", {**form, "num_inference_steps": "30"})
        finally:
            turbo.stop()
    finally:
        exact.stop()
    assert fast.ok and named.ok and slow.ok, (fast.error, named.error, slow.error)
    assert (fast.result["model"], fast.result["replica"]) == ("tiny-turbo", turbo.names[0])
    assert (fast.result["params"]["num_inference_steps"], fast.result["params"]["guidance_scale"]) == (4, 1.0)
    assert fast.result["served"]["recipe"] == FOUR_STEPS.sampling() and "turbo" in fast.result["served"]["fused"]
    assert named.result["replica"] == exact.names[0] and named.result["params"]["num_inference_steps"] == 4
    assert named.result["served"]["recipe"] == FOUR_STEPS.sampling()
    assert slow.result["params"]["num_inference_steps"] == 30 and "recipe" not in slow.result.get("served", {})
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)["video_sha256"] == fast.result["video_sha256"]
    assert http.status_code == 200, http.text
    assert hashlib.sha256(http.content).hexdigest() == fast.result["video_sha256"]
    assert bad_cli.returncode == 2 and "'--steps'" in bad_cli.stderr and "4 fixed timesteps" in bad_cli.stderr, \
        bad_cli.stderr
    assert bad_http.status_code == 400 and bad_http.json()["error"]["param"] == "num_inference_steps", bad_http.text
    (replica,) = models["tiny-turbo"]["replicas"]
    assert (replica["fused"], replica["recipe"]) == (["turbo"], FOUR_STEPS.describe())
    assert models["tiny"]["replicas"][0]["loras"] == ["turbo"] and models["tiny"]["replicas"][0]["recipe"] is None


@pytest.mark.cluster
def test_the_isolation_protocol_passes_on_a_fused_model(redis_db, tiny_model, tmp_path):
    """vllm-omni's protocol (test_isolation.protocol) on replicas of the fused few-step model: one records the
    baseline serially, two others replay it at concurrency 4, all 16 inputs bit for bit, each sampled with the
    recipe."""
    registries = save_tiny_turbo(tiny_model, tmp_path / "kit", seed=6)
    rep = protocol(redis_db(), "fused", tmp_path, {"REPLICADP_LORAS": str(registries["fused"]),
                                                   "OUTPUT_DIR": str(tmp_path / "out")})
    entries = json.loads((tmp_path / "baseline.json").read_text())["entries"].values()
    assert {(e["params"]["num_inference_steps"], e["params"]["guidance_scale"]) for e in entries} == {(4, 1.0)}
    assert rep["isolation"]["matched"] == 16
