"""Models, without replicas: `describe-model` (sizes, FLOPs, whether the GPUs hold it), `calibrate-mag` (MagCache's
ratios for the fast path), `make-tiny-model`, `make-tiny-lora` and `make-tiny-turbo` (random-weight stand-ins for
offline use)."""

from __future__ import annotations

import os
from pathlib import Path

import click

from replicadp_tasks.contract import DEFAULTS, REFERENCE_SIZE, InvalidRequest
from replicadp_tasks.model import GPU_MEMORY_GIB, PEAK_TFLOPS

from ..progress import console
from .group import main
from .options import PEAKS, json_to, layout_param, size_param, write_json


@main.command("describe-model")
@click.argument("spec")
@click.option("--size", default=REFERENCE_SIZE, show_default=True, callback=size_param,
              help="WIDTHxHEIGHT, for the FLOPs.")
@click.option("--num-frames", default=DEFAULTS["num_frames"], show_default=True)
@click.option("--steps", default=DEFAULTS["num_inference_steps"], show_default=True)
@click.option("--peak-tflops", default=PEAK_TFLOPS, show_default=True, help=f"The chip's bf16 TFLOP/s ({PEAKS}).")
@click.option("--gpus", default=1, show_default=True, type=click.IntRange(1, 8),
              help="GPUs per replica (GPUS_PER_REPLICA), for the memory check.")
@click.option("--gpu-memory-gib", default=GPU_MEMORY_GIB, show_default=True,
              type=click.FloatRange(min=0, min_open=True), help="Each GPU's memory, for the memory check.")
@click.option("--parallel", "layout", default="none", envvar="REPLICADP_PARALLEL", show_default=True,
              show_envvar=True, callback=layout_param, help="A layout over K ranks: each rank's share.")
@click.option("--recipe", envvar="REPLICADP_RECIPE", show_envvar=True, metavar="TABLE",
              help="A few-step sampling recipe, e.g. '{num_inference_steps = 4, guidance_scale = 1.0}': its FLOPs "
                   "per request beside the exact path's (REPLICADP_LORAS' adapters' recipes are shown too).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, allow_dash=True, path_type=Path), callback=json_to,
              help="Write the figures as JSON to this file, or to stdout with - (the table then goes to stderr).")
def describe_model(spec, size, num_frames, steps, peak_tflops, gpus, gpu_memory_gib, layout, recipe, json_out):
    """Each component's parameter count and size, built on the meta device (nothing is allocated), each
    transformer expert's FLOPs per request, and whether the replica's GPUs hold the weights. SPEC: random:ARCH
    (or ARCH), or a tiny spec (tiny, tiny-wan2.1, tiny-a14b, tiny-i2v-a14b)."""
    from ..bench.describe import architecture_of, figures, print_figures

    try:
        name = architecture_of(spec)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="SPEC")
    from dataclasses import replace

    from replicadp_tasks.contract import ModelLoadError
    from replicadp_tasks.settings import SETTINGS

    try:
        # The deployment's choices (its settings), with this layout: what a replica would refuse of them too.
        options = replace(SETTINGS.model_options(), spec=spec, layout=layout, recipe=recipe)
        fig = figures(name, width=size[0], height=size[1], num_frames=num_frames, steps=steps,
                      peak_tflops=peak_tflops, gpus=gpus, gpu_memory_gib=gpu_memory_gib, options=options)
    except ModelLoadError as exc:  # REPLICADP_LORAS's file, REPLICADP_MAG_RATIOS's, a recipe
        raise click.ClickException(str(exc))
    print_figures(fig)
    if json_out:
        write_json(json_out, fig)


@main.command("calibrate-mag")
@click.option("--model", default=lambda: os.environ.get("REPLICADP_MODEL", "tiny"),
              show_default="REPLICADP_MODEL, else tiny", help="The served model, as its replicas name it.")
@click.option("--size", default=REFERENCE_SIZE, show_default=True, callback=size_param, help="WIDTHxHEIGHT.")
@click.option("--num-frames", default=DEFAULTS["num_frames"], show_default=True)
@click.option("--steps", default=DEFAULTS["num_inference_steps"], show_default=True,
              help="Denoising steps; requests with another count use the ratios interpolated.")
@click.option("--prompts", default=2, show_default=True, type=click.IntRange(1, 64), help="Requests averaged.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path),
              help="Default: REPLICADP_MAG_RATIOS, else the model cache's file for the model (where replicas look).")
def calibrate_mag_cmd(model, size, num_frames, steps, prompts, out):
    """MagCache's ratios for REPLICADP_CACHE=mag, measured on MODEL here (this process's GPU, else the CPU):
    the exact path on a few requests, the residual magnitude ratio at each step, written where replicas read it."""
    from replicadp_tasks.contract import ModelLoadError

    from ..ops.calibrate import calibrate, ratios_path

    out = out or ratios_path(model)
    try:
        saved = calibrate(model, width=size[0], height=size[1], num_frames=num_frames, steps=steps, prompts=prompts,
                          out=out)
    except (ModelLoadError, InvalidRequest) as exc:
        raise click.ClickException(str(exc))
    console.print(f"MagCache ratios of {model!r} ({steps} steps, {prompts} requests, {saved['seconds']:.1f} s on "
                  f"{saved['device']}) written to {out}")


@main.command("make-tiny-model")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--variant", type=click.Choice(["wan2.2-ti2v", "wan2.1-t2v", "wan2.2-t2v-a14b", "wan2.2-i2v-a14b"]),
              default="wan2.2-ti2v", show_default=True)
def make_tiny_model(directory, variant):
    """Write a tiny random-weight Wan pipeline (save_pretrained layout) for offline tests and demos."""
    from replicadp_tasks.model import ensure_tiny_model

    console.print(f"tiny {variant} model in {ensure_tiny_model(directory, variant)}")


@main.command("make-tiny-lora")
@click.argument("out_file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--model", default="tiny", show_default=True, help="The tiny model it adapts (tiny, tiny-a14b, ...).")
@click.option("--seed", default=0, show_default=True, help="Its random weights' seed: another seed, another adapter.")
@click.option("--expert", type=click.Choice(["transformer", "transformer_2"]), default="transformer",
              show_default=True)
def make_tiny_lora(out_file, model, seed, expert):
    """Write a small random LoRA adapter (peft, seeded) for a tiny model, as one safetensors file that
    REPLICADP_LORAS can register: for trying adapters offline."""
    from replicadp_tasks.model import TINY_SPECS, resolve_model, save_tiny_lora
    from replicadp_tasks.settings import SETTINGS

    if model not in TINY_SPECS:
        raise click.BadParameter(f"{model!r}: one of {', '.join(TINY_SPECS)}", param_hint="--model")
    path = save_tiny_lora(resolve_model(model, SETTINGS.model_cache), out_file, seed, expert=expert)
    console.print(f"LoRA for {model}'s {expert} (seed {seed}) in {path}")


@main.command("make-tiny-turbo")
@click.argument("folder", type=click.Path(file_okay=False, path_type=Path))
@click.option("--model", default="tiny", show_default=True, help="The tiny model it adapts (tiny, tiny-a14b, ...).")
@click.option("--seed", default=0, show_default=True, help="Its random weights' seed.")
def make_tiny_turbo(folder, model, seed):
    """Write a tiny few-step kit for a tiny model into FOLDER: an adapter in LightX2V's key layout (a pair, one per
    expert, for tiny-a14b) and two registries of it with a 4-step, no-CFG recipe: fused.toml, to serve the
    few-step model (`up --loras FOLDER/fused.toml`), and adapters.toml, to switch it on per request."""
    from replicadp_tasks.model import TINY_SPECS, resolve_model, save_tiny_turbo
    from replicadp_tasks.settings import SETTINGS

    if model not in TINY_SPECS:
        raise click.BadParameter(f"{model!r}: one of {', '.join(TINY_SPECS)}", param_hint="--model")
    registries = save_tiny_turbo(resolve_model(model, SETTINGS.model_cache), folder, seed)
    console.print(f"few-step kit for {model} in {folder}: {registries['fused']} (fused at load), "
                  f"{registries['adapters']} (per request)")
