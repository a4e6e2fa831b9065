"""The tables that `replicadp bench`, `demo` and `sweep` print, from their reports (run.report's dicts)."""

from __future__ import annotations

from rich.markup import escape
from rich.table import Table

from ..progress import console
from .isolation import describe_mismatch, verdict


def fmt(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def print_report(rep: dict) -> None:
    """One bench run: throughput, latency, the DiT's figures, each replica's share, scaling and isolation."""
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
    if len(rep.get("per_model") or {}) > 1:
        for name, m in sorted(rep["per_model"].items()):
            t.add_row(f"model {name}", f"{m['completed']} completed on {len(m['replicas'])} replica(s), "
                                       f"{m['videos_per_min']:.2f} videos/min, "
                                       f"latency p50 {fmt(m['latency_s']['p50'])} s")
    for name, r in sorted(rep["per_replica"].items()):
        peak = f", peak memory {r['peak_memory_gib']:.1f} GiB" if r.get("peak_memory_gib") is not None else ""
        t.add_row(f"  {name}", f"{r['requests']} requests, busy {r['busy_s']:.2f} s{peak}")
    if "scaling" in rep:
        t.add_row("scaling / efficiency", f"{rep['scaling']:.2f}x / {100 * rep['efficiency']:.1f}%")
    iso = rep.get("isolation")
    if iso and "matched" in iso:
        t.add_row("isolation", f"[{'green' if iso['passed'] else 'red'}]{verdict(iso)}[/]")
    elif iso:
        t.add_row("baseline", f"{iso['recorded']} inputs recorded in {iso['baseline_written']} ({iso['format']}'s "
                              "format)")
    console.print(t)
    for m in (iso or {}).get("mismatches", []):
        console.print(f"[{'yellow' if m['tolerated'] else 'red'}]mismatch[/] {escape(describe_mismatch(m))}",
                      highlight=False)
    for m in (iso or {}).get("not_verified", []):  # a vllm-omni baseline's inputs this run did not reproduce
        line = f"seed={m['seed']} prompt={m['prompt']!r}: in the baseline, no output in this run"
        console.print(f"[red]not verified[/] {escape(line)}", highlight=False)
    for e in rep["errors"]:
        console.print(f"[red]failed[/red] request {e['index']} (seed {e['seed']}): {e['error']}")


def print_demo(cfg, reports: list[dict], iso: dict) -> None:
    """The demo's two phases side by side, then the isolation verdict and where the videos are."""
    t = Table(title=f"replicadp demo: {cfg.model}, {cfg.width}x{cfg.height}, {cfg.num_frames} frames, {cfg.steps} "
                    f"steps, {cfg.num_requests} requests")
    for col in ("replicas", "concurrency", "videos/min", "scaling", "efficiency", "p50 latency"):
        t.add_column(col, justify="right")
    for rep in reports:
        t.add_row(str(rep["replicas"]), str(rep["config"]["concurrency"]), f"{rep['videos_per_min']:.1f}",
                  f"{rep['scaling']:.2f}x", f"{100 * rep['efficiency']:.0f}%", f"{rep['latency_s']['p50']:.2f} s")
    console.print(t)
    console.print(f"isolation [{'green' if iso['passed'] else 'red'}]{verdict(iso)}[/] (2 replicas under "
                  "concurrency against 1 replica serially)")
    for m in iso["mismatches"]:
        console.print(f"[red]mismatch[/] {escape(describe_mismatch(m))}", highlight=False)
    console.print(f"videos: {iso['output_dir']}")


def print_sweep(reports: list[dict], title: str) -> None:
    """One row per replica count."""
    t = Table(title=title)
    for col in ("replicas", "concurrency", "videos/min", "scaling", "efficiency", "p50 latency", "p90 latency", "failed"):
        t.add_column(col, justify="right")
    for r in reports:
        t.add_row(str(r["replicas"]), str(r["config"]["concurrency"]), f"{r['videos_per_min']:.2f}",
                  f"{r['scaling']:.2f}x", f"{100 * r['efficiency']:.1f}%", f"{r['latency_s']['p50']:.2f} s",
                  f"{r['latency_s']['p90']:.2f} s", str(r["failed"]))
    console.print(t)
