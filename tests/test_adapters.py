"""LoRA adapters per request (REPLICADP_LORAS, adapters.py): the registry file and what it refuses, the `loras`
field, tiny adapters made here offline (peft, seeded), a pipeline holder that switches exactly a request's
adapters on and all of them off after it (also after a failure), so that no request's output depends on the
requests before it; then a replica with two registered adapters, asked through Python, the CLI and HTTP."""

import hashlib
import json
import os
import subprocess

import numpy as np
import pytest
import redis
import torch
from safetensors.torch import load_file, save_file

from conftest import run_client_on, start_replicas
from helpers import holder
from test_http import REPLICADP, gateway, post
from test_isolation import protocol

from replicadp_tasks.contract import Accepts, InvalidRequest, ModelLoadError, RequestCancelled, validate_request
from replicadp_tasks.contract.keys import REPLICA_KEY
from replicadp_tasks.contract.request import check_loras
from replicadp_tasks.model import ModelOptions, PipelineHolder, read_registry, save_tiny_lora

REQUEST = {"prompt": "a fox with a style", "seed": 5, "height": 64, "width": 64, "num_frames": 5,
           "num_inference_steps": 4}


@pytest.fixture(scope="module")
def registry(tiny_model, tmp_path_factory):
    """Two tiny adapters of the tiny model (seeds 1 and 2) and a registry naming them: style (default scale 0.8)
    and motion."""
    folder = tmp_path_factory.mktemp("loras")
    for name, seed in (("style", 1), ("motion", 2)):
        save_tiny_lora(tiny_model, folder / f"{name}.safetensors", seed)
    path = folder / "loras.toml"
    path.write_text(f'[adapters.style]\nsource = "{folder}/style.safetensors"\nscale = 0.8\n\n'
                    f'[adapters.motion]\nsource = "{folder}/motion.safetensors"\n')
    return path


def write(tmp_path, text: str) -> str:
    path = tmp_path / "loras.toml"
    path.write_text(text)
    return str(path)


def test_a_registry_that_is_wrong_is_refused_naming_the_adapter_and_the_key(tmp_path):
    """REPLICADP_LORAS's file, checked before anything loads: each mistake names the setting, the adapter and
    what is wrong; a good one reads back with the default scale 1 and every expert."""
    cases = [("[adapters]\n", "no \\[adapters.NAME\\] table"),
             ("[adapters.style\n", "cannot read it"),
             ('[adapters.Style]\nsource = "x"\n', "adapter 'Style': a name is 1-64 of a-z"),
             ("[adapters.style]\nscale = 1\n", "adapter 'style': source must be"),
             ('[adapters.style]\nsource = "x"\nscale = 9\n', "adapter 'style': scale=9 must be a number from -4 to 4"),
             ('[adapters.style]\nsource = "x"\nexperts = ["vae"]\n', "experts=\\['vae'\\] must list some of"),
             ('[adapters.style]\nsource = "x"\nweight = 1\n', "expected the keys source, scale, experts")]
    for text, error in cases:
        with pytest.raises(ModelLoadError, match=f"REPLICADP_LORAS='.*': .*{error}"):
            read_registry(write(tmp_path, text))
    (reg,) = read_registry(write(tmp_path, '[adapters.style]\nsource = "/a/style.safetensors"\n'))
    assert (reg.name, reg.source, reg.scale, reg.experts) == ("style", "/a/style.safetensors", 1.0, None)
    (near,) = read_registry(write(tmp_path, '[adapters.style]\nsource = "loras/style.safetensors"\n'))
    assert near.source == str(tmp_path.resolve() / "loras" / "style.safetensors")  # beside the file
    with pytest.raises(ModelLoadError, match="REPLICADP_LORAS='/no/such.toml': cannot read it"):
        read_registry("/no/such.toml")


def test_the_loras_field_is_checked_and_put_in_one_order():
    """`loras`: a list of at most 4 {name, scale}; with the registry known, an unknown name names the registered
    ones and a missing scale takes the adapter's default; names once, |scale| <= 4; sorted by name (the order
    adapters are applied in, and part of the identity, which only a request with adapters carries)."""
    registered = {"style": 0.8, "motion": 1.0}
    assert check_loras([{"name": "style"}, {"name": "motion", "scale": 0.5}], registered) == (
        ("motion", 0.5), ("style", 0.8))
    assert check_loras([{"name": "style"}]) == (("style", None),)  # a producer: the replica fills the scale
    for value, error in (("style", "must be a list of at most 4"), ([{"name": "a"}] * 5, "at most 4"),
                         ([{"name": "style", "weight": 1}], "each entry must be an object"),
                         ([{"name": "nope"}], "loras='nope': no such adapter here; registered: motion, style"),
                         ([{"name": "style"}, {"name": "style"}], "loras='style': is named twice"),
                         ([{"name": "style", "scale": 5}], "loras=5: a scale must be a number from -4 to 4"),
                         ([{"name": "style", "scale": True}], "a scale must be a number")):
        with pytest.raises(InvalidRequest, match=error):
            check_loras(value, registered)
    plain = validate_request(dict(REQUEST)).params()
    styled = validate_request({**REQUEST, "loras": [{"name": "style"}]}, Accepts(loras=registered)).params()
    assert "loras" not in plain and styled["loras"] == [{"name": "style", "scale": 0.8}]
    with pytest.raises(InvalidRequest, match="loras='style': no such adapter here; registered: none"):
        validate_request({**REQUEST, "loras": [{"name": "style"}]}, Accepts(loras={}))


def test_an_adapter_that_cannot_load_stops_the_replica_by_name(tiny_model, registry, tmp_path):
    """At load: a missing file, and an adapter whose weights do not fit the model (one tensor of another shape),
    each stop the load naming REPLICADP_LORAS and the adapter; adapters with compile, FP8, offloading or a layout
    over several ranks are refused by name before anything loads."""
    broken = load_file(registry.parent / "style.safetensors")
    key = next(k for k in broken if k.endswith("lora_B.weight"))
    broken[key] = torch.zeros(broken[key].shape[0] + 1, broken[key].shape[1])
    save_file(broken, tmp_path / "broken.safetensors")
    for source, error in ((tmp_path / "none.safetensors", "No such file"), (tmp_path / "broken.safetensors", "size")):
        path = write(tmp_path, f'[adapters.bad]\nsource = "{source}"\n')
        h = PipelineHolder(ModelOptions("tiny", model_cache=tiny_model.parent, loras_file=path))
        with pytest.raises(ModelLoadError, match=f"(?s)REPLICADP_LORAS: adapter 'bad' \\({source}\\): cannot load it: "
                                                 f".*{error}"):
            h.load()
    with pytest.raises(ModelLoadError, match="REPLICADP_LORAS cannot be combined with REPLICADP_COMPILE=blocks"):
        PipelineHolder(ModelOptions("tiny", model_cache=tiny_model.parent, loras_file=str(registry), compile="blocks")).load()


@pytest.fixture(scope="module")
def adapted(tiny_model, registry):
    """A holder of the tiny model with the two adapters registered, and one without any."""
    return (holder("tiny", tiny_model.parent, loras_file=str(registry)), holder("tiny", tiny_model.parent))


def frames(h: PipelineHolder, loras=None, on_step=None) -> np.ndarray:
    req = validate_request({**REQUEST, **({"loras": loras} if loras else {})}, Accepts(loras=h.lora_scales))
    return h.generate(req, on_step=on_step)


def active_layers(h: PipelineHolder) -> int:
    """LoRA layers of the holder's transformer that would add their adapters now."""
    return sum(1 for m in h.pipe.transformer.modules()
               if hasattr(m, "lora_A") and not m.disable_adapters and m.active_adapters)


INPUTS = [None, [{"name": "style"}], [{"name": "style", "scale": 0.5}], [{"name": "style"}, {"name": "motion",
                                                                                         "scale": 0.7}]]


def test_a_request_runs_with_exactly_its_adapters_whatever_ran_before(adapted):
    """No adapter, one at its default scale, one at another scale, two together: each input's frames are the same
    run first, last, or after any other (three orders), each differs from the others, and the input without
    adapters gives, bit for bit, the frames of a holder that never loaded any. After every request no LoRA layer
    is active."""
    h, plain = adapted
    seen = {}
    for order in ([0, 1, 2, 3], [3, 2, 1, 0], [2, 0, 3, 1, 0, 2]):
        for i in order:
            f = frames(h, INPUTS[i])
            assert active_layers(h) == 0
            if i in seen:
                assert np.array_equal(seen[i], f), f"input {i} changed after other requests ran"
            seen[i] = f
    assert np.array_equal(seen[0], frames(plain))
    assert len({f.tobytes() for f in seen.values()}) == 4


def test_a_failed_or_cancelled_request_leaves_no_adapter_on(adapted):
    """A request with both adapters stopped at its second step (the cancel a replica's step callback raises), and
    one that fails inside the pipeline (an adapter whose scale makes it raise): afterwards no LoRA layer is
    active and a request without adapters gives the frames it gave before."""
    h, _ = adapted
    before = frames(h)

    def cancel(step, total):
        if step == 2:
            raise RequestCancelled("cancelled at step 2")

    with pytest.raises(RequestCancelled):
        frames(h, INPUTS[3], on_step=cancel)
    assert active_layers(h) == 0
    assert np.array_equal(before, frames(h))

    def fail(step, total):
        assert active_layers(h) > 0  # the request's adapters are on while it runs
        raise RuntimeError("a failure mid-request")

    with pytest.raises(RuntimeError, match="a failure mid-request"):
        frames(h, INPUTS[1], on_step=fail)
    assert active_layers(h) == 0
    assert np.array_equal(before, frames(h))


@pytest.mark.cluster
def test_a_replica_serves_registered_adapters_through_python_the_cli_and_http(redis_db, registry, tmp_path):
    """A replica with two registered adapters: its published info, `status --json` and /v1/models list them; the
    same request naming `style` at 0.5 and `motion` through Python, `replicadp generate --lora` and the HTTP form
    gives one video (frames and MP4), its Result reporting the adapters, scales and files; a request without them
    gives another; an unknown name is refused naming `loras` by the CLI (usage error) and the gateway (400)."""
    url = redis_db()
    group = start_replicas(1, url, "loras", REPLICADP_LORAS=str(registry), OUTPUT_DIR=str(tmp_path))
    env = {**os.environ, "REDIS_URL": url}
    try:
        info = json.loads(redis.Redis.from_url(url).get(REPLICA_KEY + group.names[0]))
        status = json.loads(subprocess.run([REPLICADP, "status", "--json"], env=env, capture_output=True,
                                           text=True, timeout=60).stdout)
        loras = [{"name": "style", "scale": 0.5}, {"name": "motion"}]
        python, plain = run_client_on(url, [{**REQUEST, "loras": loras}, REQUEST], concurrency=1, timeout=120)
        cli = subprocess.run([REPLICADP, "generate", REQUEST["prompt"], "--seed", "5", "--size", "64x64",
                              "--num-frames", "5", "--steps", "4", "--lora", "style:0.5", "--lora", "motion",
                              "--json"], env=env, capture_output=True, text=True, timeout=120)
        bad_cli = subprocess.run([REPLICADP, "generate", "x", "--lora", "nope"], env=env, capture_output=True,
                                 text=True, timeout=60)
        form = {"prompt": REQUEST["prompt"], "seed": "5", "size": "64x64", "num_frames": "5",
                "num_inference_steps": "4", "loras": json.dumps(loras)}
        with gateway(url, "loras") as gw:
            models = gw.client.get("/v1/models").json()
            http = post(gw, "/v1/videos/sync", form)
            bad_http = post(gw, "/v1/videos/sync", {**form, "loras": '[{"name": "nope"}]'})
            not_json = post(gw, "/v1/videos/sync", {**form, "loras": "style"})
    finally:
        group.stop()
    assert [(a["name"], a["scale"], a["experts"]) for a in info["loras"]] == [
        ("style", 0.8, ["transformer"]), ("motion", 1.0, ["transformer"])]
    assert status["replicas"][0]["loras"] == ["style", "motion"]
    assert models["data"][0]["replicas"][0]["loras"] == ["style", "motion"]
    assert python.ok and plain.ok, (python.error, plain.error)
    result = python.result
    assert result["params"]["loras"] == [{"name": "motion", "scale": 1.0}, {"name": "style", "scale": 0.5}]
    assert result["served"]["loras"] == {a["name"]: a["sha256"] for a in info["loras"]}
    assert "loras" not in plain.result["params"] and plain.result["frames_sha256"] != result["frames_sha256"]
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)["video_sha256"] == result["video_sha256"]
    assert http.status_code == 200, http.text
    assert hashlib.sha256(http.content).hexdigest() == result["video_sha256"]
    assert bad_cli.returncode == 2 and "'--lora'" in bad_cli.stderr and "no such adapter here" in bad_cli.stderr
    assert bad_http.status_code == 400 and bad_http.json()["error"]["param"] == "loras", bad_http.text
    assert not_json.status_code == 400 and "loras" in not_json.json()["error"]["message"], not_json.text


@pytest.mark.cluster
def test_the_isolation_protocol_passes_with_adapters_mixed_in(redis_db, registry, tmp_path):
    """vllm-omni's protocol (test_isolation.protocol) with inputs that run with no adapter, one at its default
    scale, and two at other scales, in turn (`replicadp bench --loras style,motion`): one replica serially records
    the baseline, then two others at concurrency 4 replay it, each request switching its adapters on a pipeline
    that served others' just before: all 16 inputs matched bit for bit, each with the adapters it named."""
    rep = protocol(redis_db(), "loras", tmp_path, {"REPLICADP_LORAS": str(registry), "OUTPUT_DIR": str(tmp_path)},
                   "--loras", "style,motion")
    assert rep["config"]["loras"] == ["style", "motion"]
    entries = json.loads((tmp_path / "baseline.json").read_text())["entries"].values()
    named = sorted(len(e["params"].get("loras", [])) for e in entries)
    assert named == [0] * 6 + [1] * 5 + [2] * 5, named


def test_a_two_expert_model_takes_adapters_per_expert_and_describe_model_lists_them(model_cache, tmp_path):
    """tiny-a14b with `low` registered into its low-noise expert only (experts = ["transformer_2"]) and `both`
    into both: each is loaded where it says, a request with `low` differs from one without and leaves no layer on;
    `replicadp describe-model` lists the registry, and names an expert a model lacks (tiny has no
    transformer_2)."""
    folder = model_cache / "tiny-a14b"
    save_tiny_lora(folder, tmp_path / "low.safetensors", seed=3, expert="transformer_2")
    save_tiny_lora(folder, tmp_path / "both.safetensors", seed=4)
    path = write(tmp_path, '[adapters.low]\nsource = "low.safetensors"\nexperts = ["transformer_2"]\n\n'
                           '[adapters.both]\nsource = "both.safetensors"\n')
    h = holder("tiny-a14b", model_cache, loras_file=path)
    assert set(h.pipe.transformer.peft_config) == {"both"}
    assert set(h.pipe.transformer_2.peft_config) == {"low", "both"}
    plain, low = frames(h), frames(h, [{"name": "low"}])
    assert not np.array_equal(plain, low) and np.array_equal(plain, frames(h))
    assert not any(not m.disable_adapters for e in (h.pipe.transformer, h.pipe.transformer_2) for m in e.modules()
                   if hasattr(m, "lora_A"))
    run = subprocess.run([REPLICADP, "describe-model", "tiny"], env={**os.environ, "REPLICADP_LORAS": path},
                         capture_output=True, text=True, timeout=120)
    assert (f"adapter 'low' ({tmp_path.resolve()}/low.safetensors), default scale 1: not for this model: this model has no "
            "transformer_2") in run.stdout, run.stdout + run.stderr
    assert f"adapter 'both' ({tmp_path.resolve()}/both.safetensors), default scale 1: into transformer" in run.stdout
