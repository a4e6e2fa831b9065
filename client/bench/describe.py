"""`replicadp describe-model`: what a model weighs, component by component, its transformers' FLOPs per request
(each expert's, for Wan2.2's two-expert A14B models; and with each few-step recipe the deployment has, beside the
exact path's), and whether the replica's GPUs can hold its weights, with
each memory option (REPLICADP_OFFLOAD), and what a layout over K ranks (REPLICADP_PARALLEL) gives each rank: the
figures for sizing a GPU and behind the bench's model FLOP utilisation."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from replicadp_tasks.contract import parse_recipe, split_refusal
from replicadp_tasks.model import (RANDOM_PREFIX, TINY_SPECS, Layout, ModelOptions, Offload, architectures, conflicts,
                                   memory, read_registry)

from ..progress import console


def architecture_of(spec: str) -> str:
    """The architecture that `spec` names (random:ARCH or ARCH, or a tiny spec such as tiny-wan2.1); ValueError if
    none."""
    name = spec.removeprefix(RANDOM_PREFIX)
    name = f"tiny-{TINY_SPECS[name]}" if name in TINY_SPECS else name
    if name not in architectures.ARCHITECTURES:
        raise ValueError(f"{spec!r}: expected random:ARCH with ARCH one of "
                         f"{', '.join(sorted(architectures.ARCHITECTURES))}, or {', '.join(TINY_SPECS)}")
    return name


def weights_per_gpu(rows: list[dict], gpus: int, gpu_memory_gib: float) -> dict:
    """The weights as served on each of `gpus` GPUs of `gpu_memory_gib`, placed as a replica places them
    (memory.placement: both experts together), and whether each GPU holds its share. Weights only: the
    activations of a request, the CUDA context and the allocator's slack come on top."""
    where = memory.placement([r["component"] for r in rows], gpus)
    per_gpu = [sum(r["served_bytes"] for r in rows if where[r["component"]] == i) for i in range(gpus)]
    return {"gpus": gpus, "gpu_memory_gib": gpu_memory_gib, "weights_bytes_per_gpu": per_gpu,
            "fits": all(b <= gpu_memory_gib * 2**30 for b in per_gpu)}


def offload_needs(name: str, gpus: int, gpu_memory_gib: float) -> list[dict]:
    """What each memory option keeps on a GPU at most (memory.needs: parameters and buffers, on the served models'
    module trees built on the meta device), whether that fits, and why an option cannot serve this replica."""
    import torch

    arch = architectures.architecture(name)
    with torch.device("meta"):
        models = architectures.build_components(arch, architectures.build_tokenizer(), torch.bfloat16)
    devices = memory.Devices([f"cuda:{i}" for i in range(gpus)], [None] * gpus, streamed=True)
    rows = []
    for option in Offload:
        why = memory.usable(option, models, devices.names)
        peak = None if why else max(n.total for n in memory.needs(models, option, devices))
        rows.append({"offload": option.value, "weights_bytes": peak,
                     "fits": None if why else peak <= gpu_memory_gib * 2**30, "unusable": why})
    return rows


def layout_figures(name: str, layout: Layout, *, width: int, height: int, num_frames: int, dit_flops: int) -> dict:
    """A replica over `layout`'s ranks: each rank's share of the transformer FLOPs (guidance on: cfg:2 gives each
    half its passes, the sequence ranks each a slice of the tokens), or why the replica would refuse the layout
    (the Ulysses degree against the heads) or this request shape (the tokens against the sequence ranks)."""
    cfg, vae = architectures.architecture(name).transformer, architectures.architecture(name).vae
    tokens = architectures.video_tokens(cfg, height=height, width=width, num_frames=num_frames,
                                        vae_spatial=vae.get("scale_factor_spatial", 8),
                                        vae_temporal=vae.get("scale_factor_temporal", 4))
    refused = layout.heads_refusal(cfg["num_attention_heads"]) or split_refusal(tokens, layout.sequence)
    return {"layout": str(layout), "ranks": layout.size, "video_tokens": tokens, "refused": refused,
            "dit_flops_per_rank": dit_flops // layout.size}


def adapter_rows(name: str, loras_file: str | None) -> list[dict]:
    """The LoRA adapters REPLICADP_LORAS registers (read, not loaded: ModelLoadError naming a mistake), each with
    the experts it would be loaded into, or why this model cannot take it (an expert it does not have)."""
    experts = list(architectures.architecture(name).experts)
    rows = []
    for reg in read_registry(loras_file):
        missing = [e for e in (reg.source if isinstance(reg.source, dict) else reg.experts or ()) if e not in experts]
        rows.append({"name": reg.name, "source": reg.source, "scale": reg.scale, "fuse": reg.fuse,
                     "experts": list(reg.source) if isinstance(reg.source, dict) else list(reg.experts or experts),
                     "refused": f"this model has no {', '.join(missing)}" if missing else None})
    return rows


def recipe_rows(name: str, options: ModelOptions, exact_flops: int, **shape) -> list[dict]:
    """The FLOPs per request of each few-step recipe the deployment has (REPLICADP_RECIPE's, and each adapter's in
    REPLICADP_LORAS), beside the exact path's: `speedup` is what the transformers' work shrinks by, the speed-up a
    GPU sees before the VAE. ModelLoadError naming a recipe that is wrong."""
    recipes = [("REPLICADP_RECIPE", parse_recipe(options.recipe, f"REPLICADP_RECIPE={options.recipe!r}"))] \
        if options.recipe else []
    recipes += [(f"adapter {reg.name!r}" + (" (fused)" if reg.fuse else ""), reg.recipe)
                for reg in read_registry(options.loras_file) if reg.recipe is not None]
    rows = []
    for of, recipe in recipes:
        experts = architectures.reference_expert_flops(name, recipe=recipe, **shape)
        flops = sum(e["dit_flops"] for e in experts.values())
        rows.append({"of": of, "recipe": recipe.describe(), "steps": recipe.num_inference_steps,
                     "guidance": recipe.guidance_scale > 1.0, "experts": experts, "dit_flops": flops,
                     "speedup": round(exact_flops / flops, 2)})
    return rows


def figures(name: str, *, width: int, height: int, num_frames: int, steps: int, peak_tflops: float,
            gpus: int = 1, gpu_memory_gib: float = architectures.GPU_MEMORY_GIB,
            options: ModelOptions | None = None) -> dict:
    """Each component's parameters (built on the meta device: nothing is allocated), each expert's steps and
    FLOPs for one request of that shape, guidance on (`dit_flops`: all experts together), whether `gpus`
    GPUs of `gpu_memory_gib` hold the weights, all resident and with each memory option, and, for the deployment's
    `options` (model/options.py): what a replica would refuse to combine (compatibility.conflicts), each rank's
    share of a layout over several (layout_figures), the LoRA adapters it would register (adapter_rows), and its
    few-step recipes' FLOPs (recipe_rows)."""
    options = options or ModelOptions(name, model_cache=Path("."))
    layout = options.layout
    rows = architectures.describe(name)
    experts = architectures.reference_expert_flops(name, width=width, height=height, num_frames=num_frames, steps=steps)
    dit_flops = sum(e["dit_flops"] for e in experts.values())
    return {"architecture": name, "components": rows,
            "request": {"width": width, "height": height, "num_frames": num_frames, "steps": steps, "guidance": True},
            "boundary_ratio": architectures.architecture(name).boundary_ratio, "experts": experts,
            "dit_flops": dit_flops, "peak_tflops": peak_tflops, "memory": weights_per_gpu(rows, gpus, gpu_memory_gib),
            "offload": offload_needs(name, gpus, gpu_memory_gib),
            "parallel": layout_figures(name, layout, width=width, height=height, num_frames=num_frames,
                                       dit_flops=dit_flops) if layout.size > 1 else None,
            "loras": adapter_rows(name, options.loras_file), "conflicts": conflicts(options),
            "recipes": recipe_rows(name, options, dit_flops, width=width, height=height, num_frames=num_frames)}


def print_figures(fig: dict) -> None:
    rows, req, flops, peak = fig["components"], fig["request"], fig["dit_flops"], fig["peak_tflops"]
    t = Table(title=f"{fig['architecture']}: parameters (meta device)")
    for col in ("component", "class", "parameters", "bf16", "served as"):
        t.add_column(col, justify="left" if col in ("component", "class") else "right")
    for r in rows:
        t.add_row(r["component"], r["class"], f"{r['parameters'] / 1e9:.3f} B", f"{r['bf16_bytes'] / 2**30:.2f} GiB",
                  f"{r['served_dtype']} {r['served_bytes'] / 2**30:.2f} GiB")
    total = sum(r["parameters"] for r in rows)
    t.add_row("total", "", f"{total / 1e9:.3f} B", f"{2 * total / 2**30:.2f} GiB",
              f"{sum(r['served_bytes'] for r in rows) / 2**30:.2f} GiB")
    console.print(t)
    shape = f"{req['width']}x{req['height']}, {req['num_frames']} frames, {req['steps']} steps, guidance on"
    if len(fig["experts"]) > 1:
        console.print(f"two experts, switched at boundary_ratio {fig['boundary_ratio']:g} (`transformer`: the "
                      f"steps at or above it; `transformer_2`: the rest)")
        for expert, e in fig["experts"].items():
            console.print(f"  {expert}: {e['steps']} steps, {e['dit_flops'] / 1e15:.2f} PFLOP")
    console.print(f"transformer FLOPs per request ({shape}): {flops / 1e15:.2f} PFLOP; {flops / (peak * 1e12):.2f} s "
                  f"at {peak:g} TFLOP/s")
    for r in fig["recipes"]:
        console.print(f"few-step recipe of {r['of']} ({r['recipe']}): {r['dit_flops'] / 1e15:.3f} PFLOP per request, "
                      f"{r['speedup']:g}x fewer than the exact path's (the speed-up a GPU sees, before the VAE); "
                      f"{r['dit_flops'] / (peak * 1e12):.2f} s at {peak:g} TFLOP/s")
    mem = fig["memory"]
    shares = " + ".join(f"{b / 2**30:.1f}" for b in mem["weights_bytes_per_gpu"])
    console.print(f"weights on {mem['gpus']} GPU(s) of {mem['gpu_memory_gib']:g} GiB: {shares} GiB: "
                  f"{'fits' if mem['fits'] else 'does NOT fit'} (weights only; activations come on top)")
    for o in fig["offload"]:
        held = (f"{memory.size(o['weights_bytes'])} at most on a GPU: {'fits' if o['fits'] else 'does NOT fit'}"
                if o["unusable"] is None else f"not for this replica ({o['unusable'].split('. ')[0]})")
        console.print(f"  REPLICADP_OFFLOAD={o['offload']}: {held}")
    par = fig["parallel"]
    if par is not None:
        name = f"REPLICADP_PARALLEL={par['layout']}"
        if par["refused"]:
            console.print(f"{name}: refused: {par['refused']}")
        else:
            per_rank = par["dit_flops_per_rank"]
            console.print(f"{name}: {par['ranks']} ranks, one GPU each, each holding every weight (the check above "
                          f"with --gpus 1); transformer FLOPs per rank {per_rank / 1e15:.2f} PFLOP: "
                          f"{per_rank / (peak * 1e12):.2f} s at {peak:g} TFLOP/s, before communication "
                          f"(bench/parallel.py --model-only prices it)")
    for refused in fig["conflicts"]:
        console.print(f"refused: {refused}")
    for a in fig["loras"]:
        where = f"not for this model: {a['refused']}" if a["refused"] else \
            f"{'fused into' if a['fuse'] else 'into'} {', '.join(a['experts'])}"
        console.print(f"REPLICADP_LORAS: adapter {a['name']!r} ({a['source']}), default scale {a['scale']:g}: "
                      f"{where}")
