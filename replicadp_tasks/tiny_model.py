"""Tiny random-weight Wan video pipelines, built fully offline.

The saved folder has the same layout as a real Wan checkpoint, so code under
test loads it with the ordinary ``diffusers.WanPipeline.from_pretrained(dir)``.
torch/diffusers/transformers are imported inside the functions because a Celery
parent process imports this module and must not pay for (or fork) torch.
"""

import os
import pathlib
import shutil
import string
import tempfile

VARIANTS = ("wan2.2-ti2v", "wan2.1-t2v")

# Pieces for a tiny SentencePiece-style unigram vocab: whole words win over
# spelling them out letter by letter; anything else falls back to <unk>.
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


def _check_variant(variant):
    if variant not in VARIANTS:
        raise ValueError(f"unknown tiny Wan variant {variant!r}; expected one of {VARIANTS}")


def _build_tokenizer():
    from transformers import T5Tokenizer

    scores = {"<pad>": 0.0, "</s>": 0.0, "<unk>": 0.0, "▁": -2.0}
    scores |= {f"▁{c}": -8.0 for c in _LETTERS}
    scores |= {c: -9.0 for c in _LETTERS}
    # A dict because "▁a" is both a word and a letter; duplicate pieces confuse Unigram ids.
    scores |= {f"▁{w}": -5.0 for w in _WORDS}
    # extra_ids=0: sentinel tokens are only for T5 span corruption, not prompts.
    return T5Tokenizer(vocab=list(scores.items()), extra_ids=0)


def build_tiny_pipeline(variant: str = "wan2.2-ti2v"):
    """Return a freshly built diffusers.WanPipeline (eval mode, fp32, seeded so the weights are the same every time)."""
    _check_variant(variant)
    import torch
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    ti2v = variant == "wan2.2-ti2v"
    tokenizer = _build_tokenizer()

    # Re-seed before every component so each one's weights do not depend on the others.
    torch.manual_seed(0)
    if ti2v:  # Wan2.2 VAE: 48 latent channels, 2x2 pixel patchify, 16x spatial compression.
        vae = AutoencoderKLWan(
            base_dim=3, z_dim=48, in_channels=12, out_channels=12, is_residual=True, patch_size=2,
            latents_mean=[0.0] * 48, latents_std=[1.0] * 48, scale_factor_spatial=16, scale_factor_temporal=4,
            dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
        )
    else:  # Wan2.1 VAE: 16 latent channels, 8x spatial compression.
        vae = AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                               temperal_downsample=[False, True, True])
    z_dim = vae.config.z_dim

    torch.manual_seed(0)
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=z_dim, out_channels=z_dim,
        text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
    )

    torch.manual_seed(0)
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    ))

    # Same scheduler class/shift as the real Wan2.2-TI2V-5B and Wan2.1-T2V-1.3B repos.
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        flow_shift=5.0 if ti2v else 3.0)

    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler,
                       transformer=transformer, expand_timesteps=ti2v)
    # Fresh modules are in train mode; UMT5 dropout would make identical runs differ.
    for module in (vae, transformer, text_encoder):
        module.eval()
    return pipe


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
