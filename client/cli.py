"""The `replicadp` command."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import click
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.progress_bar import ProgressBar
from rich.table import Table

from replicadp_tasks.architectures import PEAK_TFLOPS

from . import bench as benchmod
from .api import ClientError, check_redis, live_replicas
from .health import REPLY_TIMEOUT_S as HEALTH_REPLY_TIMEOUT_S
from .health import STALL_S as HEALTH_STALL_S

# Piped output (logs, CI, tests) is not wrapped at 80 columns.
console = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 160)


def parse_size(ctx, param, value: str) -> tuple[int, int]:
    try:
        w, h = value.lower().split("x")
        w, h = int(w), int(h)
        if w <= 0 or h <= 0:
            raise ValueError
        return w, h
    except ValueError:
        raise click.BadParameter(f"{value!r}: expected WIDTHxHEIGHT, e.g. 832x480") from None


def progress_bar(total: int) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("{task.fields[flight]}"), console=console, transient=True)


def flight_text(in_flight) -> str:
    running = [f for f in in_flight if f.total_steps]
    return " ".join(f"[{f.replica or '?'} {f.step}/{f.total_steps}]" for f in running[:4])


@click.group()
def main():
    """replicadp: replica data parallelism for video diffusion models on Celery + Redis."""
    # SIGTERM unwinds like Ctrl-C, so the demo, sweep and bench stop what they started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


@main.command()
@click.option("--num-requests", default=16, show_default=True, help="Timed requests.")
@click.option("--concurrency", default=4, show_default=True, help="Requests in flight at most (closed loop).")
@click.option("--warmup", default=-1, show_default=True, help="Untimed warm-up requests; -1 = concurrency.")
@click.option("--base-seed", default=42, show_default=True, help="Request i gets seed base_seed + i.")
@click.option("--prompts-file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="One prompt per line (default: a built-in pool of 8).")
@click.option("--negative-prompt", default="", help="Negative prompt for every request.")
@click.option("--size", default="832x480", show_default=True, callback=parse_size, help="WIDTHxHEIGHT.")
@click.option("--num-frames", default=33, show_default=True)
@click.option("--steps", default=30, show_default=True, help="Denoising steps.")
@click.option("--model", default=None, help="Expected model; fail if the live replicas serve another.")
@click.option("--timeout", default=1800.0, show_default=True, help="Seconds per request.")
@click.option("--save-dir", type=click.Path(file_okay=False, path_type=Path), help="Write the MP4s here.")
@click.option("--label", default="", help="A name for this run in the report.")
@click.option("--baseline-tpm", type=float, help="One-replica videos/min, to print scaling and efficiency.")
@click.option("--write-baseline", type=click.Path(dir_okay=False, path_type=Path), help="Record output hashes per input.")
@click.option("--check-baseline", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Compare output hashes per input with a recorded baseline.")
@click.option("--tolerance-psnr", type=float, metavar="DB",
              help="With --check-baseline: also pass a mismatch whose decoded video has a PSNR of at least DB dB "
                   "against its own baseline, higher than against any other input's (for hardware whose kernels "
                   "cannot be made deterministic; off: bit-exact only).")
@click.option("--peak-tflops", default=PEAK_TFLOPS, show_default=True,
              help="The chip's bf16 TFLOP/s, for the DiT's model FLOP utilisation (H200: 790 measured; A800: 312).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), help="Write the report as JSON.")
def bench(num_requests, concurrency, warmup, base_seed, prompts_file, negative_prompt, size, num_frames, steps,
          model, timeout, save_dir, label, baseline_tpm, write_baseline, check_baseline, tolerance_psnr, peak_tflops,
          json_out):
    """Throughput benchmark (vllm-omni's bench_replica_dp protocol) with an optional isolation check."""
    if write_baseline and check_baseline:
        raise click.UsageError("--write-baseline and --check-baseline are exclusive: record first, then check")
    if tolerance_psnr is not None and not check_baseline:
        raise click.UsageError(f"--tolerance-psnr {tolerance_psnr:g}: only with --check-baseline")
    if num_requests < 1 or concurrency < 1:
        raise click.UsageError("--num-requests and --concurrency must be at least 1")
    prompts = benchmod.PROMPTS
    if prompts_file:
        prompts = tuple(line.strip() for line in prompts_file.read_text().splitlines() if line.strip())
        if not prompts:
            raise click.BadParameter(f"{prompts_file}: no prompts", param_hint="--prompts-file")
    cfg = benchmod.BenchConfig(num_requests=num_requests, concurrency=concurrency, warmup=warmup,
                               base_seed=base_seed, prompts=prompts, negative_prompt=negative_prompt,
                               width=size[0], height=size[1], num_frames=num_frames, steps=steps,
                               timeout=timeout, label=label, peak_tflops=peak_tflops)
    rep = run_bench(cfg, model=model, save_dir=save_dir, baseline_tpm=baseline_tpm,
                    write_baseline=write_baseline, check_baseline=check_baseline, tolerance_psnr=tolerance_psnr)
    if json_out:
        json_out.write_text(json.dumps(rep, indent=1))
        console.print(f"report written to {json_out}")
    isolation = rep.get("isolation")
    sys.exit(0 if rep["failed"] == 0 and (isolation is None or isolation.get("passed", True)) else 1)


def run_bench(cfg, *, model=None, save_dir=None, baseline_tpm=None, write_baseline=None, check_baseline=None,
              tolerance_psnr=None, quiet=False) -> dict:
    """The bench command's body, also used by the demo. Prints the report; returns it."""
    try:
        check_redis()
    except ClientError as exc:
        raise click.ClickException(str(exc))
    live = wait_for_replicas(cfg.timeout)
    if model:
        import redis

        from .api import redis_url
        from .status import replica_info

        served = {info.get("model") for info in replica_info(redis.Redis.from_url(redis_url()), live).values()}
        if served != {model}:
            raise click.ClickException(f"--model {model!r}: the live replicas serve {sorted(map(str, served))}")
    with progress_bar(cfg.num_requests) as bar:
        task = bar.add_task(f"bench {cfg.label}".strip(), total=cfg.num_requests, flight="")

        def on_update(in_flight, finished):
            bar.update(task, advance=1 if finished else 0, flight=flight_text(in_flight))

        rep, outcomes = benchmod.run(cfg, replicas=len(live), on_update=on_update)
    if baseline_tpm:
        benchmod.add_scaling(rep, baseline_tpm)
    if write_baseline:
        rep["isolation"] = {"baseline_written": str(write_baseline), **benchmod.write_baseline(write_baseline, outcomes)}
    if check_baseline:
        rep["isolation"] = {"baseline": str(check_baseline),
                            **benchmod.check_baseline(check_baseline, outcomes, tolerance_psnr)}
    if save_dir:
        benchmod.save_videos(outcomes, save_dir)
    if not quiet:
        print_report(rep)
    return rep


def wait_for_replicas(timeout: float) -> list[str]:
    live = live_replicas()
    if not live:
        console.print(f"[yellow]no live replica yet; waiting up to {timeout:.0f} s (start some with worker_launch.sh "
                      "or `replicadp up`)[/yellow]")
        deadline = time.monotonic() + timeout
        while not live and time.monotonic() < deadline:
            time.sleep(1.0)
            live = live_replicas()
        if not live:
            raise click.ClickException(f"no live replica after {timeout:.0f} s")
    return live


def fmt(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def print_report(rep: dict) -> None:
    t = Table(title=f"replicadp bench {rep['label']}".strip(), show_header=False)
    t.add_row("model", str(rep["model"]))
    t.add_row("replicas (live)", str(rep["replicas"]))
    t.add_row("completed / failed", f"{rep['completed']} / {rep['failed']}")
    t.add_row("makespan", f"{rep['makespan_s']:.2f} s")
    t.add_row("throughput", f"{rep['videos_per_min']:.2f} videos/min ({rep['videos_per_s']:.3f} videos/s)")
    lat = rep["latency_s"]
    t.add_row("latency p50 / p90 / p99", f"{fmt(lat['p50'])} / {fmt(lat['p90'])} / {fmt(lat['p99'])} s")
    t.add_row("latency min / max", f"{fmt(lat['min'])} / {fmt(lat['max'])} s")
    t.add_row("queue wait p50 / inference p50", f"{fmt(rep['queue_wait_s']['p50'], '.3f')} / "
                                                f"{fmt(rep['inference_s']['p50'], '.3f')} s")
    if rep.get("dit_tflops_per_s") is not None:
        mfu = "" if rep["mfu"] is None else f", MFU {100 * rep['mfu']:.1f}% of {rep['config']['peak_tflops']:g}"
        t.add_row("DiT (denoising loop) p50", f"{fmt(rep['dit_s']['p50'])} s at {rep['dit_tflops_per_s']:.2f} TFLOP/s{mfu}")
    for name, r in sorted(rep["per_replica"].items()):
        peak = f", peak memory {r['peak_memory_gib']:.1f} GiB" if r.get("peak_memory_gib") is not None else ""
        t.add_row(f"  {name}", f"{r['requests']} requests, busy {r['busy_s']:.2f} s{peak}")
    if "scaling" in rep:
        t.add_row("scaling / efficiency", f"{rep['scaling']:.2f}x / {100 * rep['efficiency']:.1f}%")
    iso = rep.get("isolation")
    if iso and "matched" in iso:
        t.add_row("isolation", f"[{'green' if iso['passed'] else 'red'}]{benchmod.verdict(iso)}[/]")
    elif iso:
        t.add_row("baseline", f"{iso['recorded']} inputs recorded in {iso['baseline_written']}")
    console.print(t)
    for m in (iso or {}).get("mismatches", []):
        console.print(f"[{'yellow' if m['tolerated'] else 'red'}]mismatch[/] {escape(benchmod.describe_mismatch(m))}",
                      highlight=False)
    for e in rep["errors"]:
        console.print(f"[red]failed[/red] request {e['index']} (seed {e['seed']}): {e['error']}")


@main.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--results", type=click.Path(dir_okay=False, path_type=Path),
              help="JSONL file results are appended to (default: FILE.results.jsonl).")
@click.option("--concurrency", default=0, show_default=True, help="Requests in flight at most; 0 = queue all.")
@click.option("--timeout", default=1800.0, show_default=True, help="Seconds per request.")
@click.option("--save-dir", type=click.Path(file_okay=False, path_type=Path), help="Fetch the MP4s into this folder.")
@click.option("--longest-first", is_flag=True, help="Submit the largest requests first (shorter makespan for mixed sizes).")
def submit(file, results, concurrency, timeout, save_dir, longest_first):
    """Submit a batch: JSONL (generate's arguments per line) or plain text (one prompt per line).

    Re-running the same file skips the requests that already completed."""
    from .api import fetch_video, run_requests
    from .submit import BatchFileError, completed_ids, read_batch

    try:
        batch = read_batch(file)
    except BatchFileError as exc:
        raise click.ClickException(str(exc))
    results = results or file.with_name(file.name + ".results.jsonl")
    done = completed_ids(results)
    todo = [(n, kw) for n, kw in batch if kw["request_id"] not in done]
    if longest_first:
        from .submit import work

        todo.sort(key=lambda item: work(item[1]), reverse=True)
    console.print(f"{len(batch)} request(s) in {file}; {len(batch) - len(todo)} already completed; "
                  f"submitting {len(todo)}")
    if not todo:
        return
    try:
        check_redis()
    except ClientError as exc:
        raise click.ClickException(str(exc))
    wait_for_replicas(timeout)
    failed = 0
    with progress_bar(len(todo)) as bar, open(results, "a") as out:
        task = bar.add_task("submit", total=len(todo), flight="")

        def on_update(in_flight, finished):
            desc = f"submit: {bar.tasks[0].completed + (1 if finished else 0) - failed} done, {failed} failed"
            bar.update(task, description=desc, flight=flight_text(in_flight))

        for o in run_requests([kw for _, kw in todo], concurrency, timeout, on_update):
            line = todo[o.index][0]
            if o.ok and save_dir:
                save_dir.mkdir(parents=True, exist_ok=True)
                (save_dir / f"{o.request['request_id']}.mp4").write_bytes(fetch_video(o.result))
            failed += not o.ok
            out.write(json.dumps({"line": line, "request_id": o.request["request_id"], "ok": o.ok,
                                  "result": o.result, "error": o.error}) + "\n")
            out.flush()
            bar.advance(task)
            if not o.ok:
                console.print(f"[red]line {line} failed[/red]: {o.error}")
    console.print(f"{len(todo) - failed} completed, {failed} failed; results in {results}")
    sys.exit(1 if failed else 0)


@main.command()
@click.option("--watch", is_flag=True, help="Refresh every second until Ctrl-C.")
def status(watch):
    """Live replicas, the request each is running and its step, queue depth, recent throughput."""
    from .status import THROUGHPUT_WINDOWS_MIN, snapshot

    try:
        check_redis()
    except ClientError as exc:
        raise click.ClickException(str(exc))

    def render():
        snap = snapshot()
        wait = snap["oldest_wait_s"]
        waited = f", the next waited {wait:.0f} s" if snap["queue_depth"] and wait is not None else ""
        rates = ", ".join(f"{snap[f'videos_per_min_{m}m']:.1f} ({m} min)" for m in THROUGHPUT_WINDOWS_MIN)
        t = Table(title=f"queue {snap['queue']!r}: {snap['queue_depth']} waiting{waited}; videos/min {rates}")
        for col in ("replica", "device", "model", "serving", "request", "denoising", "step", "running"):
            t.add_column(col)
        for r in snap["replicas"]:
            total = r["total_steps"]
            step = f"{r['step']}/{total}" if total else ("starting" if r["request_id"] else "idle")
            bar = ProgressBar(total=total, completed=r["step"] or 0, width=24) if total else ""
            running = "-" if r["running_s"] is None else f"{r['running_s']:.0f} s"
            t.add_row(r["name"], str(r["device"]), str(r["model"]), "yes" if r["serving"] else "loading",
                      str(r["request_id"] or "-"), bar, step, running)
        if not snap["replicas"]:
            t.caption = "no live replica"
        return t

    if not watch:
        console.print(render())
        return
    with Live(render(), console=console, refresh_per_second=2) as live:
        try:
            while True:
                time.sleep(1.0)
                live.update(render())
        except KeyboardInterrupt:
            pass


@main.command()
@click.option("--replicas", "n", default=1, show_default=True, help="Replicas to start.")
@click.option("--devices", default="cpu", show_default=True, help="GPU ids (0,1,...) or cpu.")
@click.option("--gpus-per-replica", default=1, show_default=True)
@click.option("--threads", type=int, help="CPU threads per replica (cpu only).")
@click.option("--model", default="tiny", show_default=True, help="Model spec: tiny, a local folder or a hub id.")
@click.option("--timeout", default=900.0, show_default=True, help="Seconds to wait for the replicas to load.")
def up(n, devices, gpus_per_replica, threads, model, timeout):
    """Start the embedded server (unless REDIS_URL is set) and N replicas in the background."""
    from .replicas import up as do_up

    try:
        state = do_up(n, model, devices, threads, gpus_per_replica, timeout)
    except (RuntimeError, TimeoutError) as exc:
        raise click.ClickException(str(exc))
    from .api import redacted

    console.print(f"up: {len(state['replicas'])} replica(s) serving {model!r} on {redacted(state['redis_url'])}; "
                  f"logs in {state['run_dir']}; stop with `replicadp down`")


@main.command()
def down():
    """Stop what `replicadp up` started."""
    from .replicas import down as do_down

    state = do_down()
    console.print("nothing is up" if state is None else f"stopped {len(state['replicas'])} replica(s)")


@main.command()
@click.option("--num-requests", default=24, show_default=True)
@click.option("--concurrency", default=4, show_default=True, help="In flight during the 2-replica run.")
@click.option("--size", default="128x128", show_default=True, callback=parse_size)
@click.option("--num-frames", default=17, show_default=True)
@click.option("--steps", default=8, show_default=True)
@click.option("--model", default="tiny", show_default=True)
@click.option("--output-dir", default="outputs/demo", show_default=True, type=click.Path(file_okay=False, path_type=Path))
def demo(num_requests, concurrency, size, num_frames, steps, model, output_dir):
    """1 replica records a baseline, 2 replicas replay it under concurrency: throughput and isolation."""
    from .demo import DemoConfig, run_demo

    cfg = DemoConfig(num_requests=num_requests, concurrency=concurrency, width=size[0], height=size[1],
                     num_frames=num_frames, steps=steps, model=model, output_dir=output_dir)
    reports, iso = run_demo(cfg, run_bench, log=lambda m: console.print(f"[dim]{m}[/dim]"))
    t = Table(title=f"replicadp demo: {model}, {size[0]}x{size[1]}, {num_frames} frames, {steps} steps, "
                    f"{num_requests} requests")
    for col in ("replicas", "concurrency", "videos/min", "scaling", "efficiency", "p50 latency"):
        t.add_column(col, justify="right")
    for rep in reports:
        t.add_row(str(rep["replicas"]), str(rep["config"]["concurrency"]), f"{rep['videos_per_min']:.1f}",
                  f"{rep['scaling']:.2f}x", f"{100 * rep['efficiency']:.0f}%", f"{rep['latency_s']['p50']:.2f} s")
    console.print(t)
    console.print(f"isolation [{'green' if iso['passed'] else 'red'}]{benchmod.verdict(iso)}[/] (2 replicas under "
                  "concurrency against 1 replica serially)")
    for m in iso["mismatches"]:
        console.print(f"[red]mismatch[/] {escape(benchmod.describe_mismatch(m))}", highlight=False)
    console.print(f"videos: {iso['output_dir']}")
    sys.exit(0 if iso["passed"] and all(r["failed"] == 0 for r in reports) else 1)


@main.command()
@click.option("--replicas", "counts", default="1,2,4,8", show_default=True, help="Replica counts to run, comma-separated.")
@click.option("--model", default="tiny", show_default=True,
              help="Model spec for the replicas; synthetic:SECONDS is the benchmark-only backend.")
@click.option("--devices", default="cpu", show_default=True, help="GPU ids (the first N are used at N) or cpu.")
@click.option("--threads", type=int, default=1, show_default=True, help="CPU threads per replica (cpu only).")
@click.option("--num-requests", default=32, show_default=True, help="Rounded up to a multiple of every N.")
@click.option("--concurrency", default=0, show_default=True, help="In flight at most; 0 = 2 x replicas.")
@click.option("--warmup", default=-1, show_default=True, help="Untimed requests per N; -1 = N.")
@click.option("--base-seed", default=42, show_default=True)
@click.option("--size", default="832x480", show_default=True, callback=parse_size)
@click.option("--num-frames", default=33, show_default=True)
@click.option("--steps", default=30, show_default=True)
@click.option("--timeout", default=1800.0, show_default=True)
@click.option("--out", default="bench-results/sweep", show_default=True, type=click.Path(path_type=Path),
              help="Output prefix: writes PREFIX.json, PREFIX.md and PREFIX.png.")
def sweep(counts, model, devices, threads, num_requests, concurrency, warmup, base_seed, size, num_frames, steps,
          timeout, out):
    """Run the same bench at each replica count; print the scaling table, write JSON, Markdown and a PNG."""
    from .sweep import even_request_count, run_sweep, write_outputs

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
    cfg = benchmod.BenchConfig(num_requests=total, concurrency=concurrency, warmup=warmup, base_seed=base_seed,
                               width=size[0], height=size[1], num_frames=num_frames, steps=steps, timeout=timeout)
    reports = run_sweep(ns, cfg, model=model, threads=threads, devices=devices, run_bench=run_bench,
                        log=lambda m: console.print(f"[dim]{m}[/dim]"), env={"HF_HUB_OFFLINE": "1"})
    title = (f"{model}, {size[0]}x{size[1]}, {num_frames} frames, {steps} steps, {total} requests, "
             f"{threads} thread(s)/replica" if devices == "cpu" else f"{model} on GPUs {devices}")
    t = Table(title=title)
    for col in ("replicas", "concurrency", "videos/min", "scaling", "efficiency", "p50 latency", "p90 latency", "failed"):
        t.add_column(col, justify="right")
    for r in reports:
        t.add_row(str(r["replicas"]), str(r["config"]["concurrency"]), f"{r['videos_per_min']:.2f}",
                  f"{r['scaling']:.2f}x", f"{100 * r['efficiency']:.1f}%", f"{r['latency_s']['p50']:.2f} s",
                  f"{r['latency_s']['p90']:.2f} s", str(r["failed"]))
    console.print(t)
    paths = write_outputs(reports, out, title)
    console.print("wrote " + ", ".join(map(str, paths)))
    sys.exit(0 if all(r["failed"] == 0 for r in reports) else 1)


@main.command("serve-http")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8098, show_default=True)
@click.option("--max-queue", default=64, show_default=True, envvar="REPLICADP_HTTP_MAX_QUEUE",
              help="Requests waiting in the queue past which new ones get 429 (env REPLICADP_HTTP_MAX_QUEUE).")
@click.option("--sync-timeout", default=1800.0, show_default=True, envvar="REPLICADP_HTTP_SYNC_TIMEOUT",
              help="Seconds a /v1/videos/sync request waits before a 504 (env REPLICADP_HTTP_SYNC_TIMEOUT).")
def serve_http(host, port, max_queue, sync_timeout):
    """HTTP front door: vllm-omni's video API (/v1/videos, /v1/videos/sync) in front of the replicas."""
    import uvicorn

    from .gateway import create_app

    try:
        check_redis()
    except ClientError as exc:
        raise click.ClickException(str(exc))
    # A sync request still waiting this long after SIGTERM is dropped, and its generation cancelled.
    uvicorn.run(create_app(max_queue=max_queue, sync_timeout=sync_timeout), host=host, port=port,
                timeout_graceful_shutdown=10)


@main.command()
@click.option("--address", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0 only in a container whose port is published on loopback).")
@click.option("--port", default=5555, show_default=True)
def flower(address, port):
    """Flower, the Celery dashboard (replicas, requests), behind basic auth: FLOWER_BASIC_AUTH=user:password,
    else a generated password, printed once."""
    import os

    from .flower import CredentialsError, credentials, exec_flower

    try:
        auth, generated = credentials(os.environ)
        check_redis()
    except (CredentialsError, ClientError) as exc:
        raise click.ClickException(str(exc))
    if generated:
        console.print(f"Flower basic auth (generated, shown once): {auth}")
    console.print(f"Flower on http://{address}:{port}/")
    exec_flower(address, port, auth)


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0 only in a container whose port is published on loopback).")
@click.option("--port", default=9808, show_default=True)
def metrics(host, port):
    """Prometheus exporter: queue depth and wait, replica busy/idle, requests completed and failed, latency and
    queue-wait histograms."""
    from .metrics import serve

    try:
        check_redis()
    except ClientError as exc:
        raise click.ClickException(str(exc))
    console.print(f"metrics on http://{host}:{port}/metrics")
    try:
        serve(host, port)
    except OSError as exc:
        raise click.ClickException(f"--host {host} --port {port}: {exc}")


@main.command()
@click.option("--replica", required=True, help="Node name, e.g. replica0@%h (%h: this host, as in `celery worker -n`).")
@click.option("--stall-after", default=HEALTH_STALL_S, show_default=True,
              help="Seconds without progress (same step, or idle beside a waiting request) that are unhealthy.")
@click.option("--timeout", default=HEALTH_REPLY_TIMEOUT_S, show_default=True, help="Seconds to wait for each reply.")
def health(replica, stall_after, timeout):
    """Exit 0 if the replica serves (answers, consumes the queue, makes progress), else 1; one line says why.
    For docker-compose's healthcheck."""
    from .health import check

    try:
        check_redis(timeout=timeout)
    except ClientError as exc:
        click.echo(f"unhealthy: {exc}")
        sys.exit(1)
    verdict = check(replica, stall_s=stall_after, timeout=timeout)
    click.echo(f"{'healthy' if verdict.healthy else 'unhealthy'}: {verdict.reason}")
    sys.exit(0 if verdict.healthy else 1)


@main.command("make-tiny-model")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--variant", type=click.Choice(["wan2.2-ti2v", "wan2.1-t2v"]), default="wan2.2-ti2v", show_default=True)
def make_tiny_model(directory, variant):
    """Write a tiny random-weight Wan pipeline (save_pretrained layout) for offline tests and demos."""
    from replicadp_tasks.tiny_model import ensure_tiny_model

    console.print(f"tiny {variant} model in {ensure_tiny_model(directory, variant)}")


@main.command("describe-model")
@click.argument("spec")
@click.option("--size", default="832x480", show_default=True, callback=parse_size, help="WIDTHxHEIGHT, for the FLOPs.")
@click.option("--num-frames", default=33, show_default=True)
@click.option("--steps", default=30, show_default=True)
@click.option("--peak-tflops", default=PEAK_TFLOPS, show_default=True, help="The chip's bf16 TFLOP/s (H200: 790).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), help="Write the figures as JSON.")
def describe_model(spec, size, num_frames, steps, peak_tflops, json_out):
    """Each component's parameter count and size, built on the meta device (nothing is allocated), and the
    transformer's FLOPs per request. SPEC: random:ARCH (or ARCH), or tiny / tiny-wan2.1."""
    from replicadp_tasks.architectures import ARCHITECTURES, describe, reference_flops
    from replicadp_tasks.pipeline import RANDOM_PREFIX, TINY_SPECS

    name = spec.removeprefix(RANDOM_PREFIX)
    name = f"tiny-{TINY_SPECS[name]}" if name in TINY_SPECS else name
    if name not in ARCHITECTURES:
        raise click.BadParameter(f"{spec!r}: expected random:ARCH with ARCH one of {', '.join(sorted(ARCHITECTURES))}"
                                 f", or {', '.join(TINY_SPECS)}", param_hint="SPEC")
    rows = describe(name)
    flops = reference_flops(name, width=size[0], height=size[1], num_frames=num_frames, steps=steps)
    t = Table(title=f"{name}: parameters (meta device)")
    for col in ("component", "class", "parameters", "bf16", "served as"):
        t.add_column(col, justify="left" if col in ("component", "class") else "right")
    for r in rows:
        t.add_row(r["component"], r["class"], f"{r['parameters'] / 1e9:.3f} B", f"{r['bf16_bytes'] / 2**30:.2f} GiB",
                  f"{r['served_dtype']} {r['served_bytes'] / 2**30:.2f} GiB")
    total = sum(r["parameters"] for r in rows)
    t.add_row("total", "", f"{total / 1e9:.3f} B", f"{2 * total / 2**30:.2f} GiB",
              f"{sum(r['served_bytes'] for r in rows) / 2**30:.2f} GiB")
    console.print(t)
    console.print(f"transformer FLOPs per request ({size[0]}x{size[1]}, {num_frames} frames, {steps} steps, guidance on): "
                  f"{flops / 1e15:.2f} PFLOP; {flops / (peak_tflops * 1e12):.2f} s at {peak_tflops:g} TFLOP/s")
    if json_out:
        json_out.write_text(json.dumps({"architecture": name, "components": rows, "request": {
            "width": size[0], "height": size[1], "num_frames": num_frames, "steps": steps, "guidance": True},
            "dit_flops": flops, "peak_tflops": peak_tflops}, indent=1))
        console.print(f"written to {json_out}")
