"""Throughput on live or started replicas: `bench` (one run, with an optional isolation check), `demo` (1 replica
then 2, throughput and isolation) and `sweep` (the same bench at each replica count)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from replicadp_tasks.contract import DEFAULTS, REFERENCE_SIZE
from replicadp_tasks.model import PEAK_TFLOPS

from ..progress import console
from .group import main
from .options import PEAKS, json_to, redis_url_option, size_param, write_json


@main.command()
@click.option("--num-requests", default=16, show_default=True, help="Timed requests.")
@click.option("--concurrency", default=4, show_default=True, help="Requests in flight at most (closed loop).")
@click.option("--warmup", default=-1, show_default=True, help="Untimed warm-up requests; -1 = concurrency.")
@click.option("--base-seed", default=42, show_default=True, help="Request i gets seed base_seed + i.")
@click.option("--prompts-file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="One prompt per line (default: a built-in pool of 8).")
@click.option("--negative-prompt", default="", help="Negative prompt for every request.")
@click.option("--size", default=REFERENCE_SIZE, show_default=True, callback=size_param, help="WIDTHxHEIGHT.")
@click.option("--num-frames", default=DEFAULTS["num_frames"], show_default=True)
@click.option("--steps", default=DEFAULTS["num_inference_steps"], show_default=True, help="Denoising steps.")
@click.option("--model", "models", multiple=True, metavar="NAME", help="A model to run on; repeat for several: "
              "request i runs on the (i mod count)th, and the report has each model's share (default: the "
              "deployment's model).")
@click.option("--quality", type=click.Choice(["standard", "fast", "mixed"]), default="standard", show_default=True,
              help="The path each request asks for; mixed: standard and fast in turn (request i: fast if i is odd).")
@click.option("--loras", default="", metavar="NAME[,NAME]", help="Registered LoRA adapters to mix in: requests in "
              "turn run with none, the first, and the first at 0.5 with the second at 1.5.")
@click.option("--timeout", default=1800.0, show_default=True, help="Seconds per request.")
@click.option("--save-dir", type=click.Path(file_okay=False, path_type=Path), help="Write the MP4s here.")
@click.option("--label", default="", help="A name for this run in the report.")
@click.option("--baseline-tpm", type=float, help="One-replica videos/min, to print scaling and efficiency.")
@click.option("--write-baseline", type=click.Path(dir_okay=False, path_type=Path),
              help="Record output hashes per input.")
@click.option("--baseline-format", type=click.Choice(["replicadp", "vllm-omni"]),
              help="What --write-baseline writes: replicadp's (both hashes and the videos, for the PSNR of a "
                   "mismatch; the default) or vllm-omni's bench_replica_dp.py manifest (input key -> MP4 md5). "
                   "--check-baseline reads either.")
@click.option("--check-baseline", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Compare output hashes per input with a recorded baseline (replicadp's or vllm-omni's).")
@click.option("--tolerance-psnr", type=float, metavar="DB",
              help="With --check-baseline: also pass a mismatch whose decoded video has a PSNR of at least DB dB "
                   "against its own baseline, higher than against any other input's (for hardware whose kernels "
                   "cannot be made deterministic; off: bit-exact only).")
@click.option("--peak-tflops", default=PEAK_TFLOPS, show_default=True,
              help=f"The chip's bf16 TFLOP/s, for the DiT's model FLOP utilisation ({PEAKS}).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, allow_dash=True, path_type=Path), callback=json_to,
              help="Write the report as JSON to this file, or to stdout with - (the tables then go to stderr).")
@redis_url_option()
def bench(num_requests, concurrency, warmup, base_seed, prompts_file, negative_prompt, size, num_frames, steps,
          models, quality, loras, timeout, save_dir, label, baseline_tpm, write_baseline, baseline_format,
          check_baseline, tolerance_psnr, peak_tflops, json_out):
    """Throughput benchmark (vllm-omni's bench_replica_dp protocol) with an optional isolation check."""
    from ..bench.isolation import BaselineError, BaselineFormat, read_baseline
    from ..bench.report import print_report
    from ..bench.run import PROMPTS, BenchConfig, run_bench

    if write_baseline and check_baseline:
        raise click.UsageError("--write-baseline and --check-baseline are exclusive: record first, then check")
    if tolerance_psnr is not None and not check_baseline:
        raise click.UsageError(f"--tolerance-psnr {tolerance_psnr:g}: only with --check-baseline")
    if baseline_format and not write_baseline:
        raise click.UsageError(f"--baseline-format {baseline_format}: only with --write-baseline (a check reads "
                               "either)")
    vllm_omni = baseline_format == BaselineFormat.VLLM_OMNI
    if check_baseline:
        try:
            vllm_omni = read_baseline(check_baseline)[0] == BaselineFormat.VLLM_OMNI
        except BaselineError as exc:
            raise click.BadParameter(str(exc), param_hint="--check-baseline")
        if vllm_omni and tolerance_psnr is not None:
            raise click.UsageError(f"--tolerance-psnr {tolerance_psnr:g}: {check_baseline} is vllm-omni's baseline, "
                                   "which keeps no videos to compare")
    if vllm_omni and quality != "standard":
        raise click.UsageError(f"--quality {quality}: vllm-omni's baseline keys carry no quality; only with "
                               "--quality standard")
    loras = tuple(name.strip() for name in loras.split(",") if name.strip())
    if vllm_omni and loras:
        raise click.UsageError("--loras: vllm-omni's baseline keys carry no adapters")
    if num_requests < 1 or concurrency < 1:
        raise click.UsageError("--num-requests and --concurrency must be at least 1")
    prompts = PROMPTS
    if prompts_file:
        prompts = tuple(line.strip() for line in prompts_file.read_text().splitlines() if line.strip())
        if not prompts:
            raise click.BadParameter(f"{prompts_file}: no prompts", param_hint="--prompts-file")
    cfg = BenchConfig(num_requests=num_requests, concurrency=concurrency, warmup=warmup, base_seed=base_seed,
                      prompts=prompts, negative_prompt=negative_prompt, width=size[0], height=size[1],
                      num_frames=num_frames, steps=steps, quality=quality, loras=loras, timeout=timeout,
                      label=label, peak_tflops=peak_tflops, models=models)
    rep = run_bench(cfg, save_dir=save_dir, baseline_tpm=baseline_tpm, write_baseline=write_baseline,
                    baseline_format=BaselineFormat(baseline_format or BaselineFormat.REPLICADP),
                    check_baseline=check_baseline, tolerance_psnr=tolerance_psnr)
    print_report(rep)
    if json_out:
        write_json(json_out, rep)
    isolation = rep.get("isolation")
    sys.exit(0 if rep["failed"] == 0 and (isolation is None or isolation.get("passed", True)) else 1)


@main.command()
@click.option("--num-requests", default=24, show_default=True)
@click.option("--concurrency", default=4, show_default=True, help="In flight during the 2-replica run.")
@click.option("--size", default="128x128", show_default=True, callback=size_param)
@click.option("--num-frames", default=17, show_default=True)
@click.option("--steps", default=8, show_default=True)
@click.option("--model", default="tiny", show_default=True)
@click.option("--output-dir", default="outputs/demo", show_default=True,
              type=click.Path(file_okay=False, path_type=Path))
@redis_url_option(help="Redis to run on (default: an embedded server, started here).", expose=True)
def demo(num_requests, concurrency, size, num_frames, steps, model, output_dir, redis_url):
    """1 replica records a baseline, 2 replicas replay it under concurrency: throughput and isolation."""
    from ..bench.demo import DemoConfig, DemoFailed, run_demo
    from ..bench.report import print_demo

    if num_requests < 1 or concurrency < 1:
        raise click.UsageError("--num-requests and --concurrency must be at least 1")
    cfg = DemoConfig(num_requests=num_requests, concurrency=concurrency, width=size[0], height=size[1],
                     num_frames=num_frames, steps=steps, model=model, output_dir=output_dir)
    try:
        reports, iso = run_demo(cfg, log=lambda m: console.print(f"[dim]{m}[/dim]"), redis_url=redis_url)
    except (DemoFailed, RuntimeError, TimeoutError) as exc:  # RuntimeError, TimeoutError: replicas that did not start
        raise click.ClickException(str(exc))
    print_demo(cfg, reports, iso)
    sys.exit(0 if iso["passed"] and all(r["failed"] == 0 for r in reports) else 1)


@main.command()
@click.option("--replicas", "counts", default="1,2,4,8", show_default=True,
              help="Replica counts to run, comma-separated.")
@click.option("--model", default="tiny", show_default=True,
              help="Model spec for the replicas; synthetic:SECONDS is the benchmark-only backend.")
@click.option("--devices", default="cpu", show_default=True, help="GPU ids (the first N are used at N) or cpu.")
@click.option("--threads", type=int, default=1, show_default=True, help="CPU threads per replica (cpu only).")
@click.option("--num-requests", default=32, show_default=True, help="Rounded up to a multiple of every N.")
@click.option("--concurrency", default=0, show_default=True, help="In flight at most; 0 = 2 x replicas.")
@click.option("--warmup", default=-1, show_default=True, help="Untimed requests per N; -1 = N.")
@click.option("--base-seed", default=42, show_default=True)
@click.option("--size", default=REFERENCE_SIZE, show_default=True, callback=size_param)
@click.option("--num-frames", default=DEFAULTS["num_frames"], show_default=True)
@click.option("--steps", default=DEFAULTS["num_inference_steps"], show_default=True)
@click.option("--timeout", default=1800.0, show_default=True)
@click.option("--out", default="bench-results/sweep", show_default=True, type=click.Path(path_type=Path),
              help="Output prefix: writes PREFIX.json, PREFIX.md and PREFIX.png.")
@redis_url_option(help="Redis to run on (default: an embedded server, started here).", expose=True)
def sweep(counts, model, devices, threads, num_requests, concurrency, warmup, base_seed, size, num_frames, steps,
          timeout, out, redis_url):
    """Run the same bench at each replica count; print the scaling table, write JSON, Markdown and a PNG."""
    from ..bench.report import print_sweep
    from ..bench.run import BenchConfig
    from ..bench.sweep import even_request_count, run_sweep, table_title, write_outputs

    try:
        ns = sorted({int(x) for x in counts.split(",")})
        if ns[0] < 1:
            raise ValueError
    except ValueError:
        raise click.BadParameter(f"{counts!r}: expected positive integers like 1,2,4,8", param_hint="--replicas")
    total = even_request_count(num_requests, ns)
    if total != num_requests:
        console.print(f"--num-requests {num_requests} -> {total}: a multiple of every N, so that no replica idles "
                      "through an uneven tail")
    cfg = BenchConfig(num_requests=total, concurrency=concurrency, warmup=warmup, base_seed=base_seed,
                      width=size[0], height=size[1], num_frames=num_frames, steps=steps, timeout=timeout)
    reports = run_sweep(ns, cfg, model=model, threads=threads, devices=devices,
                        log=lambda m: console.print(f"[dim]{m}[/dim]"), env={"HF_HUB_OFFLINE": "1"},
                        redis_url=redis_url)
    title = table_title(model, devices, threads, cfg)
    print_sweep(reports, title)
    paths = write_outputs(reports, out, title)
    console.print("wrote " + ", ".join(map(str, paths)))
    sys.exit(0 if all(r["failed"] == 0 for r in reports) else 1)
