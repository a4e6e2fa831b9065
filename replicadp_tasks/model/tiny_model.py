"""Tiny random-weight Wan video pipelines, built fully offline.

The saved folder has the same layout as a real Wan checkpoint, so code under
test loads it with the ordinary ``diffusers.WanPipeline.from_pretrained(dir)``
(``WanImageToVideoPipeline`` for the image-to-video A14B stand-in: its
model_index.json names the class).
torch/diffusers/transformers are imported inside the functions because a Celery
parent process imports this module and must not pay for (or fork) torch.
"""

import os
import pathlib
import shutil
import tempfile

# Each is architectures.py's `tiny-VARIANT`; the A14B ones have two differently seeded experts and a boundary.
VARIANTS = ("wan2.2-ti2v", "wan2.1-t2v", "wan2.2-t2v-a14b", "wan2.2-i2v-a14b")


def _check_variant(variant):
    if variant not in VARIANTS:
        raise ValueError(f"unknown tiny Wan variant {variant!r}; expected one of {VARIANTS}")


def build_tiny_pipeline(variant: str = "wan2.2-ti2v"):
    """Return a freshly built diffusers.WanPipeline, or WanImageToVideoPipeline for "wan2.2-i2v-a14b" (eval
    mode, fp32, seeded so the weights are the same every time)."""
    _check_variant(variant)
    from .architectures import build_pipeline

    return build_pipeline(f"tiny-{variant}")


def save_tiny_model(directory, variant: str = "wan2.2-ti2v") -> pathlib.Path:
    """Build and save_pretrained into `directory` atomically.

    Builds in a sibling temp dir, then os.rename()s it into place; if another process won the race
    (directory exists with model_index.json), discards ours and returns the existing one. Returns the path.
    """
    _check_variant(variant)
    directory = pathlib.Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    # Sibling dir: same filesystem, so the rename is atomic and readers never see a half-written model.
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
    tmp.chmod(0o755)  # mkdtemp makes it 0700; the model is shared, e.g. with workers running as another user
    try:
        from diffusers.utils import logging as diffusers_logging
        from transformers.utils import logging as transformers_logging

        # A progress bar for one tiny shard is noise in the demo's output.
        diffusers_logging.disable_progress_bar()
        transformers_logging.disable_progress_bar()
        build_tiny_pipeline(variant).save_pretrained(tmp)
        try:
            os.rename(tmp, directory)  # fails if directory exists and is non-empty
        except OSError:
            if not (directory / "model_index.json").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return directory


def ensure_tiny_model(directory, variant="wan2.2-ti2v") -> pathlib.Path:
    """Return directory if it already holds model_index.json, else save_tiny_model."""
    _check_variant(variant)
    directory = pathlib.Path(directory)
    if (directory / "model_index.json").exists():
        return directory
    return save_tiny_model(directory, variant)


def save_tiny_lora(model_dir, out_file, seed: int, rank: int = 4, expert: str = "transformer") -> pathlib.Path:
    """A small random LoRA (peft, seeded: the same bytes every time) for `expert` of the tiny model in `model_dir`,
    saved as diffusers' LoRA loaders read it (one safetensors file, `out_file`): the tests' and the docs' adapters.
    Its A and B are random (not B = 0, peft's default), so that switching it on changes the video."""
    import torch
    from diffusers import WanPipeline, WanTransformer3DModel
    from peft import LoraConfig, get_peft_model_state_dict

    transformer = WanTransformer3DModel.from_pretrained(model_dir, subfolder=expert)
    torch.manual_seed(seed)
    transformer.add_adapter(LoraConfig(r=rank, lora_alpha=rank, init_lora_weights=False,
                                       target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    out_file = pathlib.Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    WanPipeline.save_lora_weights(out_file.parent, transformer_lora_layers=get_peft_model_state_dict(transformer),
                                  weight_name=out_file.name)
    return out_file


# The layers a distilled Wan adapter adapts, as LightX2V and Wan2.2 Lightning publish them (the original Wan key
# layout: `diffusion_model.blocks.N.<layer>.lora_down/lora_up.weight` and `.alpha`), and diffusers' names for them.
DISTILL_LAYERS = {"self_attn.q": "attn1.to_q", "self_attn.k": "attn1.to_k", "self_attn.v": "attn1.to_v",
                  "self_attn.o": "attn1.to_out.0", "cross_attn.q": "attn2.to_q", "cross_attn.k": "attn2.to_k",
                  "cross_attn.v": "attn2.to_v", "cross_attn.o": "attn2.to_out.0", "ffn.0": "ffn.net.0.proj",
                  "ffn.2": "ffn.net.2"}


def save_tiny_distill_lora(model_dir, out_file, seed: int, rank: int = 4, expert: str = "transformer",
                           strength: float = 0.5) -> pathlib.Path:
    """A small random adapter in LightX2V's key layout (the original Wan names, lora_down/lora_up with an alpha,
    and a `diff_b` bias delta on each layer, as LightX2V's have) for `expert` of the tiny model in `model_dir`, seeded:
    the same bytes every time. diffusers converts the layout as it loads it (the stand-in for a distilled adapter:
    it changes the video, as a real one does, but was distilled from nothing). `strength` bounds each delta."""
    import torch
    from diffusers import WanTransformer3DModel
    from safetensors.torch import save_file

    transformer = WanTransformer3DModel.from_pretrained(model_dir, subfolder=expert)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for i, _ in enumerate(transformer.blocks):
        for original, ours in DISTILL_LAYERS.items():
            layer = transformer.get_submodule(f"blocks.{i}.{ours}")
            key = f"diffusion_model.blocks.{i}.{original}"
            down = torch.randn(rank, layer.in_features, generator=generator) * strength / layer.in_features ** 0.5
            tensors[f"{key}.lora_down.weight"] = down
            tensors[f"{key}.lora_up.weight"] = torch.randn(layer.out_features, rank, generator=generator) * strength
            tensors[f"{key}.alpha"] = torch.tensor(float(rank))
            tensors[f"{key}.diff_b"] = torch.randn(layer.out_features, generator=generator) * strength * 0.1
    out_file = pathlib.Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_file))
    return out_file


# The stand-ins' recipe: Wan2.2 Lightning's and LightX2V's published 4-step one (no CFG: one pass a step).
TURBO_RECIPE = ('{ num_inference_steps = 4, guidance_scale = 1.0, scheduler = "flow-match-euler", shift = 5.0, '
                'timesteps = [1000, 750, 500, 250] }')


def save_tiny_turbo(model_dir, folder, seed: int = 0) -> dict[str, pathlib.Path]:
    """A tiny few-step kit for the tiny model in `model_dir`, in `folder`: a distilled-layout adapter per expert
    (save_tiny_distill_lora; a pair for a two-expert model, as Wan2.2 Lightning's) and two registries
    (REPLICADP_LORAS) of it with TURBO_RECIPE: `fused.toml` fuses it at load (a replica of the few-step model),
    `adapters.toml` registers it as `turbo`, switched on by the requests naming it. Returns the registries."""
    model_dir, folder = pathlib.Path(model_dir), pathlib.Path(folder)
    experts = [e for e in ("transformer", "transformer_2") if (model_dir / e).is_dir()]
    files = {e: save_tiny_distill_lora(model_dir, folder / f"turbo-{e}.safetensors", seed + i, expert=e).name
             for i, e in enumerate(experts)}
    source = f'"{files["transformer"]}"' if len(files) == 1 else \
        "{ " + ", ".join(f'{e} = "{name}"' for e, name in files.items()) + " }"
    registries = {}
    for name, fuse in (("fused", "true"), ("adapters", "false")):
        registries[name] = folder / f"{name}.toml"
        registries[name].write_text(f"[adapters.turbo]\nsource = {source}\nfuse = {fuse}\nrecipe = {TURBO_RECIPE}\n")
    return registries
