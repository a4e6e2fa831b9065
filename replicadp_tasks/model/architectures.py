"""Wan architectures that replicadp builds itself, with random weights: the tiny stand-ins that tests and the
demo load, and the full-size models that GPU benchmarks run where the weights cannot be downloaded (the same
compute as the real checkpoints: only the numbers in the weights differ). Also what each weighs, and the DiT's
FLOPs per forward pass, from its config.

Wan2.2's A14B models are two experts of the same architecture: `transformer` denoises the high-noise steps (the
timesteps >= boundary_ratio * num_train_timesteps), `transformer_2` the rest (diffusers' WanPipeline and
WanImageToVideoPipeline switch between them at that boundary).

torch, diffusers and transformers are imported inside the functions: a Celery main process imports this module
and must not initialise CUDA before it forks.
"""

from __future__ import annotations

import string
from dataclasses import dataclass, field

from ..contract.request import DEFAULTS, Tokens

TEXT_LEN = 512  # tokens the pipelines pad every prompt to (max_sequence_length)
# The chip whose model FLOP utilisation reports give by default: an estimate of an H200's sustained bf16 matrix
# throughput (its datasheet's dense peak is 989), not a measurement: no GPU has run this code yet, and
# scripts/gpu_check.sh measures it. An A800/A100's datasheet peak is 312.
PEAK_TFLOPS = 790.0
# The GPU memory that describe-model checks a model's weights against by default: the same H200's, as the lab's
# device description gives it (about 139 GiB usable), not measured here.
GPU_MEMORY_GIB = 139.0
# UMT5-xxl, the text encoder of every Wan2.1 / 2.2 model (5.7 B parameters).
UMT5_XXL = dict(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                relative_attention_num_buckets=32, relative_attention_max_distance=128,
                feed_forward_proj="gated-gelu")
_WAN_BLOCKS = dict(patch_size=(1, 2, 2), freq_dim=256, text_dim=4096, cross_attn_norm=True,
                   qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024, num_layers=30)
# The 14B transformer of Wan2.1-T2V-14B and of each Wan2.2 A14B expert: dim 5120 = 40 heads x 128, ffn 13824,
# 40 layers, freq_dim 256, text_dim 4096 (Wan-Video/Wan2.2 wan/configs/wan_t2v_A14B.py and wan_i2v_A14B.py;
# the same in diffusers' scripts/convert_wan_to_diffusers.py, "Wan-T2V-14B", "Wan2.2-T2V-A14B" and
# "Wan2.2-I2V-14B-720p", with added_kv_proj_dim None: no CLIP image branch, also in the I2V A14B).
_WAN_14B = dict(_WAN_BLOCKS, num_attention_heads=40, attention_head_dim=128, ffn_dim=13824, num_layers=40,
                out_channels=16)
# Wan2.1's VAE (z_dim 16, base_dim 96: AutoencoderKLWan's defaults, which diffusers' convert_vae builds), used by
# every Wan2.1 model and by Wan2.2's A14B models (wan_*_A14B.py: vae_checkpoint 'Wan2.1_VAE.pth').
_WAN21_VAE = dict(base_dim=96, z_dim=16)
# The image-to-video transformer's input: 16 noise channels, 4 of first-frame mask (one per frame of the VAE's
# temporal stride) and 16 of image latents (WanImageToVideoPipeline.prepare_latents concatenates them).
_I2V_IN_CHANNELS = 16 + 4 + 16
# The tiny stand-ins (configs from diffusers' own Wan tests): seconds per request on a CPU core.
_TINY_BLOCKS = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, text_dim=32, freq_dim=256,
                    ffn_dim=32, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
_TINY_VAE = dict(base_dim=3, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True])
_TINY_UMT5 = dict(vocab_size=None, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
                  relative_attention_num_buckets=8)


@dataclass(frozen=True)
class Architecture:
    """The constructor arguments of each component of one Wan pipeline."""

    transformer: dict
    vae: dict
    text_encoder: dict = field(default_factory=lambda: dict(UMT5_XXL))  # UMT5Config; vocab None: the tokenizer's
    flow_shift: float = 5.0  # UniPC's shift: the real repo's scheduler config, or Wan's published sample_shift
    ti2v: bool = True  # Wan2.2 TI2V: per-token timesteps (expand_timesteps), and a first frame may be given
    # Two experts (Wan2.2 A14B): a second transformer of the same config, for the steps below this boundary.
    boundary_ratio: float | None = None
    i2v: bool = False  # image-to-video (WanImageToVideoPipeline): a first frame is required
    # The published sampling defaults: guidance for `transformer` (the high-noise expert) and for `transformer_2`
    # (None: one expert). A request that leaves one out gets the model's (request_defaults).
    guidance_scale: float = 5.0
    guidance_scale_2: float | None = None

    @property
    def experts(self) -> tuple[str, ...]:
        """The pipeline's transformer components: `transformer`, and `transformer_2` for a two-expert model."""
        return ("transformer",) if self.boundary_ratio is None else ("transformer", "transformer_2")

    @property
    def request_defaults(self) -> dict:
        """What a request to this model gets for a field it leaves out, over validate.DEFAULTS: its guidance."""
        two = {} if self.guidance_scale_2 is None else {"guidance_scale_2": self.guidance_scale_2}
        return {"guidance_scale": self.guidance_scale, **two}


def architecture_of(transformer_config, boundary_ratio: float | None, i2v: bool) -> str | None:
    """The architecture a loaded pipeline is (a hub model, a folder, a tiny stand-in): the one whose transformer
    arguments the transformer's config has, with the same boundary and kind; None for a model of none of them."""
    def same(a, b) -> bool:
        return list(a) == list(b) if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) else a == b

    for name, arch in ARCHITECTURES.items():
        if (arch.boundary_ratio == boundary_ratio and arch.i2v == i2v
                and all(same(transformer_config.get(k), v) for k, v in arch.transformer.items())):
            return name
    return None


ARCHITECTURES = {
    # Wan2.2-TI2V-5B: the production model (transformer 5.0 B, VAE 0.7 B, UMT5-xxl 5.7 B).
    "wan2.2-ti2v-5b": Architecture(
        transformer=dict(_WAN_BLOCKS, num_attention_heads=24, attention_head_dim=128, ffn_dim=14336,
                         in_channels=48, out_channels=48),
        vae=dict(base_dim=160, decoder_base_dim=256, z_dim=48, in_channels=12, out_channels=12, is_residual=True,
                 patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4,
                 latents_mean=[0.0] * 48, latents_std=[1.0] * 48),
    ),
    # Wan2.1-T2V-1.3B: text-to-video only, Wan2.1's 16-channel VAE (its defaults).
    "wan2.1-t2v-1.3b": Architecture(
        transformer=dict(_WAN_BLOCKS, num_attention_heads=12, attention_head_dim=128, ffn_dim=8960,
                         in_channels=16, out_channels=16),
        vae=dict(base_dim=96, z_dim=16),
        flow_shift=3.0, ti2v=False,
    ),
    # Wan2.1-T2V-14B (Wan-Video/Wan2.1 wan/configs/wan_t2v_14B.py): one 14B transformer, Wan2.1's VAE. Shift 5.0
    # and guidance 5.0: Wan2.1's generate.py defaults for t2v (3.0 is its 480p shift for i2v; diffusers' converter
    # writes 3.0 into every Wan2.1 scheduler config).
    "wan2.1-t2v-14b": Architecture(
        transformer=dict(_WAN_14B, in_channels=16), vae=_WAN21_VAE, flow_shift=5.0, ti2v=False,
    ),
    # Wan2.2-T2V-A14B (wan/configs/wan_t2v_A14B.py): two 14B experts, boundary 0.875 (diffusers' converter writes
    # the same boundary_ratio), sample_shift 12.0, sample_guide_scale (3.0, 4.0) as (low noise, high noise).
    # The shift is Wan's published config; vllm-omni's serving defaults differ (5.0 at 720p, 12.0 at 480p), and
    # diffusers' converter writes 3.0: each deployment may set its own.
    "wan2.2-t2v-a14b": Architecture(
        transformer=dict(_WAN_14B, in_channels=16), vae=_WAN21_VAE, flow_shift=12.0, ti2v=False,
        boundary_ratio=0.875, guidance_scale=4.0, guidance_scale_2=3.0,
    ),
    # Wan2.2-I2V-A14B (wan/configs/wan_i2v_A14B.py): the same experts with image channels, boundary 0.900 (the
    # converter's boundary_ratio=0.9), sample_shift 5.0, sample_guide_scale (3.5, 3.5). No CLIP image encoder,
    # and one timestep per sample (expand_timesteps False): the first frame enters as latents only.
    "wan2.2-i2v-a14b": Architecture(
        transformer=dict(_WAN_14B, in_channels=_I2V_IN_CHANNELS), vae=_WAN21_VAE, flow_shift=5.0, ti2v=False,
        boundary_ratio=0.900, i2v=True, guidance_scale=3.5, guidance_scale_2=3.5,
    ),
    "tiny-wan2.2-ti2v": Architecture(
        transformer=dict(_TINY_BLOCKS, in_channels=48, out_channels=48),
        vae=dict(_TINY_VAE, z_dim=48, in_channels=12, out_channels=12, is_residual=True, patch_size=2,
                 latents_mean=[0.0] * 48, latents_std=[1.0] * 48, scale_factor_spatial=16, scale_factor_temporal=4),
        text_encoder=_TINY_UMT5,
    ),
    "tiny-wan2.1-t2v": Architecture(
        transformer=dict(_TINY_BLOCKS, in_channels=16, out_channels=16),
        vae=dict(_TINY_VAE, z_dim=16),
        text_encoder=_TINY_UMT5,
        flow_shift=3.0, ti2v=False,
    ),
    # The A14B stand-ins: two tiny experts, with the real models' boundaries, shifts and guidance, so that a
    # request of a few steps runs both experts (4 steps of the T2V one: 3 on `transformer`, 1 on `transformer_2`).
    "tiny-wan2.2-t2v-a14b": Architecture(
        transformer=dict(_TINY_BLOCKS, in_channels=16, out_channels=16),
        vae=dict(_TINY_VAE, z_dim=16),
        text_encoder=_TINY_UMT5,
        flow_shift=12.0, ti2v=False, boundary_ratio=0.875, guidance_scale=4.0, guidance_scale_2=3.0,
    ),
    "tiny-wan2.2-i2v-a14b": Architecture(
        transformer=dict(_TINY_BLOCKS, in_channels=_I2V_IN_CHANNELS, out_channels=16),
        vae=dict(_TINY_VAE, z_dim=16),
        text_encoder=_TINY_UMT5,
        flow_shift=5.0, ti2v=False, boundary_ratio=0.900, i2v=True, guidance_scale=3.5, guidance_scale_2=3.5,
    ),
}

# Pieces for a small SentencePiece-style unigram vocab: whole words win over spelling them out letter by letter;
# anything else falls back to <unk>. Ids stay below every model's vocab size.
_WORDS = (
    "a an the of in on at to with and or is are was under over near by from into"
    " red orange yellow green blue purple pink black white gray brown gold silver"
    " fox dog cat bird fish horse cow car boat train plane tree flower river sea"
    " sky sun moon star cloud rain snow city street house road forest mountain"
    " beach field park room man woman child person people robot dragon"
    " running walking flying swimming jumping dancing sitting standing eating"
    " slowly quickly small big large tall old young happy bright dark night day"
    " morning evening light video camera shot close up view scene style cinematic"
    " realistic photo painting 4k hd high quality detailed motion"
).split()
_LETTERS = string.ascii_letters + string.digits + string.punctuation


def architecture(name: str) -> Architecture:
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise ValueError(f"unknown architecture {name!r}; expected one of {sorted(ARCHITECTURES)}") from None


def build_tokenizer():
    """A T5 tokenizer built from a word list, with no files (transformers 5 takes the vocab directly)."""
    from transformers import T5Tokenizer

    scores = {"<pad>": 0.0, "</s>": 0.0, "<unk>": 0.0, "▁": -2.0}
    scores |= {f"▁{c}": -8.0 for c in _LETTERS}
    scores |= {c: -9.0 for c in _LETTERS}
    # A dict because "▁a" is both a word and a letter; duplicate pieces confuse Unigram ids.
    scores |= {f"▁{w}": -5.0 for w in _WORDS}
    # extra_ids=0: sentinel tokens are only for T5 span corruption, not prompts.
    return T5Tokenizer(vocab=list(scores.items()), extra_ids=0)


def build_components(arch: Architecture, tokenizer, dtype=None) -> dict:
    """The models of `arch` (the VAE, the transformer or two experts, the text encoder), built on the current
    default device (`with torch.device(...)`) in eval mode. Each is seeded on its own, so its weights are the same
    in every process and on every build; `transformer_2` with another seed than `transformer`, so that the experts
    differ. Each transformer and the text encoder are cast to `dtype` (if given) as soon as each is built, so that
    at most one of them is ever in fp32 (for the 5B model on a GPU: a peak of 36 GB rather than 46); the VAE stays
    fp32."""
    import torch
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(0)
    parts = {"vae": AutoencoderKLWan(**arch.vae)}
    for seed, name in enumerate(arch.experts):
        torch.manual_seed(seed)
        parts[name] = WanTransformer3DModel(**arch.transformer)
        if dtype is not None:
            cast(parts[name], dtype)
    torch.manual_seed(0)
    text_config = {**arch.text_encoder, "vocab_size": arch.text_encoder["vocab_size"] or len(tokenizer)}
    text_encoder = UMT5EncoderModel(UMT5Config(
        **text_config, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id))
    if dtype is not None:
        cast(text_encoder, dtype)
    parts["text_encoder"] = text_encoder
    # Fresh modules are in train mode; UMT5's dropout would make identical runs differ.
    return {name: model.eval() for name, model in parts.items()}


def build_pipeline(name: str, device: str = "cpu", dtype=None):
    """A diffusers WanPipeline of architecture `name` with random weights (a WanImageToVideoPipeline for an
    image-to-video one, with no CLIP image encoder, as Wan2.2-I2V-A14B has none), built directly on `device`
    (never on the meta device then `to_empty()`: Wan's rope tables are non-persistent buffers computed at
    construction). Two experts and their boundary where the architecture has them. The transformers and text
    encoder are cast to `dtype` (default: left fp32) as from_pretrained would, keeping the modules a model lists
    in `_keep_in_fp32_modules`; the VAE stays fp32."""
    import torch
    from diffusers import WanImageToVideoPipeline, WanPipeline

    arch = architecture(name)
    tokenizer = build_tokenizer()
    with torch.device(device):
        parts = build_components(arch, tokenizer, dtype)
    pipeline_class = WanImageToVideoPipeline if arch.i2v else WanPipeline
    return pipeline_class(tokenizer=tokenizer, scheduler=build_scheduler(arch), expand_timesteps=arch.ti2v,
                          boundary_ratio=arch.boundary_ratio, **parts)


def build_scheduler(arch: Architecture):
    """UniPC with flow sigmas and the architecture's shift, as the real repos' scheduler configs."""
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                   flow_shift=arch.flow_shift)


def cast(model, dtype) -> None:
    """Cast `model`'s weights to `dtype` in place, keeping in fp32 what from_pretrained(dtype=...) would: a
    diffusers model's `_keep_in_fp32_modules` at any dtype (Wan's norms and time embedding), a transformers
    model's only at fp16 (UMT5's `wo`), besides its `_keep_in_fp32_modules_strict`."""
    import torch
    from diffusers import ModelMixin

    keep = set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    if isinstance(model, ModelMixin) or dtype == torch.float16:
        keep |= set(getattr(model, "_keep_in_fp32_modules", None) or ())
    for name, param in model.named_parameters():
        if param.dtype != dtype and not keep.intersection(name.split(".")):
            param.data = param.data.to(dtype)


def describe(name: str) -> list[dict]:
    """Each component's parameter count and size, from a build on the meta device (nothing allocated): the text
    encoder, the transformer (and `transformer_2`, the low-noise expert, where there are two), the VAE."""
    import torch

    arch = architecture(name)
    with torch.device("meta"):
        parts = build_components(arch, build_tokenizer())
    rows = []
    for key in ("text_encoder", *arch.experts, "vae"):
        params = sum(p.numel() for p in parts[key].parameters())
        dtype, size = ("fp32", 4) if key == "vae" else ("bf16", 2)  # the VAE decodes in fp32 (bf16 shows banding)
        rows.append({"component": key, "class": type(parts[key]).__name__, "parameters": params,
                     "bf16_bytes": 2 * params, "served_dtype": dtype, "served_bytes": size * params})
    return rows


def dit_flops(config, tokens: int, text_len: int = TEXT_LEN, timestep_tokens: int = 1) -> int:
    """FLOPs of one forward pass of a WanTransformer3DModel with `config`, on one sample of `tokens` video tokens
    and `text_len` text tokens: every matrix product (2 FLOPs per multiply-add), attention included.
    `timestep_tokens`: Wan2.2 TI2V embeds a timestep per video token (expand_timesteps), Wan2.1 one per sample.
    Checked against torch's FlopCounterMode in tests/test_architectures.py."""
    d = config["num_attention_heads"] * config["attention_head_dim"]
    pt, ph, pw = config["patch_size"]
    patch_in, patch_out = config["in_channels"] * pt * ph * pw, config["out_channels"] * pt * ph * pw
    L, T = tokens, text_len
    block = (
        4 * L * d * d + 2 * L * L * d  # self-attention: q, k, v, out; scores and values
        + 2 * L * d * d + 2 * T * d * d + 2 * L * T * d  # cross-attention: q, out on video; k, v on text
        + 2 * L * d * config["ffn_dim"]  # feed-forward
    )
    embed = (
        L * patch_in * d  # patch embedding (a strided conv)
        + timestep_tokens * (config["freq_dim"] * d + d * d + d * 6 * d)  # time embedding and modulation
        + T * (config["text_dim"] * d + d * d)  # text projection
        + L * d * patch_out  # output projection
    )
    return 2 * (config["num_layers"] * block + embed)


def tokens_of(config, *, vae_spatial: int, vae_temporal: int) -> Tokens:
    """How a transformer of this config, behind a VAE of these strides, cuts a video into tokens."""
    return Tokens(vae_temporal=vae_temporal, vae_spatial=vae_spatial, patch=tuple(config["patch_size"]))


def video_tokens(config, *, height: int, width: int, num_frames: int, vae_spatial: int, vae_temporal: int) -> int:
    """The video tokens a transformer pass of this shape runs on: latent frames x latent patches."""
    return tokens_of(config, vae_spatial=vae_spatial, vae_temporal=vae_temporal).count(height, width, num_frames)


def request_flops(config, *, height: int, width: int, num_frames: int, steps: int, guidance: bool,
                  vae_spatial: int, vae_temporal: int, per_token_timesteps: bool, text_len: int = TEXT_LEN) -> int:
    """The transformer's FLOPs for `steps` denoising steps of one request: a forward pass per step, two with
    classifier-free guidance. For two experts, call it for each with the steps it runs (expert_steps)."""
    tokens = video_tokens(config, height=height, width=width, num_frames=num_frames, vae_spatial=vae_spatial,
                          vae_temporal=vae_temporal)
    per_pass = dit_flops(config, tokens, text_len, timestep_tokens=tokens if per_token_timesteps else 1)
    return per_pass * steps * (2 if guidance else 1)


def expert_steps(scheduler, steps: int, boundary_ratio: float | None) -> tuple[int, int]:
    """How many of `steps` denoising steps each expert runs: (transformer, transformer_2). The pipelines' rule:
    a step whose timestep is >= boundary_ratio * num_train_timesteps goes to `transformer`, the others to
    `transformer_2`; with no boundary, all to `transformer`. Computed on a copy of `scheduler` (its timesteps
    depend on the shift), so that the pipeline's own is left as it is."""
    if boundary_ratio is None:
        return steps, 0
    copy = type(scheduler).from_config(scheduler.config)
    copy.set_timesteps(steps)
    boundary = boundary_ratio * copy.config.num_train_timesteps
    high = sum(1 for t in copy.timesteps if t >= boundary)
    return high, len(copy.timesteps) - high


def reference_expert_flops(name: str, *, height: int = DEFAULTS["height"], width: int = DEFAULTS["width"],
                           num_frames: int = DEFAULTS["num_frames"],
                           steps: int = DEFAULTS["num_inference_steps"], recipe=None) -> dict[str, dict]:
    """Each expert of architecture `name`: the steps it runs and its `request_flops`, by default for the
    reference request (guidance on), or for a request sampling with `recipe` (contract/recipe.py: its steps,
    guidance and scheduler). `{"transformer": {"steps": ..., "dit_flops": ...}, ...}`."""
    from .sampling import scheduler_for

    arch = architecture(name)
    guidance = True if recipe is None else recipe.guidance_scale > 1.0  # the pipelines' rule, as request_flops'
    steps = steps if recipe is None else recipe.num_inference_steps
    split = expert_steps(scheduler_for(build_scheduler(arch), recipe), steps, arch.boundary_ratio)  # (steps, 0): one
    return {expert: {"steps": n, "dit_flops": request_flops(
                arch.transformer, height=height, width=width, num_frames=num_frames, steps=n, guidance=guidance,
                vae_spatial=arch.vae.get("scale_factor_spatial", 8),
                vae_temporal=arch.vae.get("scale_factor_temporal", 4), per_token_timesteps=arch.ti2v)}
            for expert, n in zip(arch.experts, split)}


def reference_flops(name: str, *, height: int = DEFAULTS["height"], width: int = DEFAULTS["width"],
                    num_frames: int = DEFAULTS["num_frames"], steps: int = DEFAULTS["num_inference_steps"]) -> int:
    """The transformers' FLOPs for a request of architecture `name` (both experts together), by default for the
    reference request (guidance on)."""
    experts = reference_expert_flops(name, height=height, width=width, num_frames=num_frames, steps=steps)
    return sum(e["dit_flops"] for e in experts.values())
