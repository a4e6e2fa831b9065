"""Figure 18: preemption (REPLICADP_PREEMPT_AFTER_S, issue #58): interactive requests arriving behind batch renders
that keep every replica busy, with preemption off and on, on 2 synthetic replicas; and what a preempted request's
saved state weighs.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/preemption.py --json bench-results/preemption.json \\
        --png bench-results/preemption.png

Two measurements:
  serving     2 synthetic replicas (GPU-like steps: --step-s a step at 64x64x5, by the model's SECONDS) are sent a
              backlog of --batch + --extra batch requests of 40-60 steps (seeded), longest-lived work that never
              lets them idle; from --lead s on, --arrivals interactive requests of 4 steps come at seeded
              exponential gaps (mean --gap s). Run on fresh replicas, the same plan each time: the interactive
              requests alone, with no batch work (alone: what they wait for each other on 2 replicas), then with
              the backlog and REPLICADP_PREEMPT_AFTER_S unset (off), then set to --after (on; 0 by default: the
              most aggressive setting, whose batch cost bounds any larger one's), with REPLICADP_MAX_PREEMPTIONS
              --max-preemptions (the default, 2); each --after and --max-preemptions repeated: one run each pair.
              Per run: each interactive request's wait before it starts (the Result's timings.queued_s: sent to
              started), p50 / p99, in seconds and in steps, and beyond alone (its wait less its wait alone); the
              batch makespan, from the first batch send until the first --batch batch requests (in sent order) have all completed (each
              completion: send + queued_s + total_s of its last start), and, less at the mercy of which request
              happens to end last, the time until as many batch steps as that set holds are done, by any batch
              request (Poller); the preemptions (replicadp:preemptions:<task id>). The --extra requests after
              the set keep the replicas busy to the end; they are cancelled.
  checkpoint  in one process, on the tiny models: a request preempted at step 2 of 8 (model.PipelineHolder, an
              on_step that raises RequestPreempted, as tests/test_preemption.py's stopped_at): its checkpoint's
              bytes (Checkpoint.to_bytes), the time to make them and to read them back (from_bytes), and to write
              and read them in Redis as a replica does (HSET of replicadp:checkpoint:<id>, HGETALL), median of 3.
              tiny at 832x480x33 has Wan2.2-TI2V-5B's latent shape (z_dim 48, spatial 16), so its size is the 5B's;
              Wan2.2-A14B at 1280x720x81 (z_dim 16, spatial 8) is computed, then timed on a state of that shape
              built from tiny-a14b's (its latent-shaped tensors replaced).

Size of a UniPC checkpoint (solver_order 2): latents (1, C, (F-1)/4+1, H/s, W/s) fp32, L = 4 C ((F-1)/4+1) (H/s)
(W/s) bytes; the scheduler adds model_outputs (2 tensors of that shape) and last_sample (one), so 4 L, plus
fixed bytes: its 1000-entry tables (betas, alphas, alphas_cumprod, alpha_t, sigma_t, lambda_t: 24 KB), its small
fields and torch.save's framing, measured on the tiny model (the last measured row's size less 4 L).
"""

from __future__ import annotations

import json
import math
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import click
import redis
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from client.local.embedded import EmbeddedServer  # noqa: E402
from client.local.replicas import Replicas  # noqa: E402
from replicadp_tasks.cluster import connection  # noqa: E402
from replicadp_tasks.contract import REFERENCE_WORK  # noqa: E402
from replicadp_tasks.contract.keys import CHECKPOINT_KEY, PREEMPTIONS_KEY  # noqa: E402

# Every serving request on the synthetic backend: 64x64, 5 frames (encoding takes milliseconds); a step lasts
# --step-s by the model's SECONDS. On a real model (--model), --size.
SHAPE = {"height": 64, "width": 64, "num_frames": 5}
BATCH_STEPS = (40, 60)  # a render of 40-60 steps
INTERACTIVE_STEPS = 4
PREEMPT_ENV = "REPLICADP_PREEMPT_AFTER_S"
MAX_ENV = "REPLICADP_MAX_PREEMPTIONS"
TASK_META = "celery-task-meta-"  # + task id: its result record, a running request's Progress

# (model, width, height, frames) run to step 2 of 8 and preempted there; then the computed rows.
MEASURED = [("tiny", 64, 64, 5), ("tiny", 256, 256, 17), ("tiny", 832, 480, 33), ("tiny-a14b", 64, 64, 5),
            ("tiny-a14b", 256, 256, 17), ("tiny-a14b", 512, 512, 33)]
# (name, width, height, frames, z_dim, spatial): architectures.py's VAEs; the temporal stride is 4 for both.
COMPUTED = [("Wan2.2-TI2V-5B", 832, 480, 33, 48, 16), ("Wan2.2-A14B", 1280, 720, 81, 16, 8)]
LATENT_DIMS = {"tiny": (48, 16), "tiny-a14b": (16, 8)}
SOLVER_TENSORS = 4  # latents, UniPC's model_outputs (solver_order 2), last_sample
REPEATS = 3


def latent_bytes(width: int, height: int, frames: int, z_dim: int, spatial: int) -> int:
    return 4 * z_dim * ((frames - 1) // 4 + 1) * (height // spatial) * (width // spatial)


def percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


# --- serving: one run on fresh replicas, off or on ------------------------------------------------------------------

def request(prompt: str, steps: int, priority: str, seed: int, shape: dict) -> dict:
    return {"prompt": prompt, "seed": seed, **shape, "num_inference_steps": steps, "priority": priority}


def purge(client, queue: str) -> None:
    """Drop what still waits: the extra backlog no one measures."""
    from replicadp_tasks.contract import queue_lists

    client.delete(*queue_lists(queue))


def serve(url: str, plan: dict, backlog: bool = True) -> dict:
    """Send the plan's batch backlog (unless not `backlog`), then its interactive arrivals at their times; wait for
    the interactive requests and the measured batch set; cancel the rest. The figures of this run."""
    from client.api import cancel_request, model_for, run_requests
    from replicadp_tasks import generate
    from replicadp_tasks.contract import queue_for
    from replicadp_tasks.settings import SETTINGS

    client = connection.client(url)
    queue = queue_for(SETTINGS.queue, model_for(None))
    # First requests on a replica pay one-off costs (ffmpeg start-up, imports).
    warm = [request(f"warm {i}", 1, "normal", i, plan["shape"]) for i in range(4)]
    assert all(o.ok for o in run_requests(warm, timeout=120))
    warm_preemption(client, plan["shape"], plan["warm_steps"])
    began = time.time()
    batch = []
    for i, steps in enumerate(plan["batch_steps"] if backlog else ()):
        sent = time.time()
        batch.append((sent, generate.apply_async(kwargs=request(f"render {i}", steps, "batch", i, plan["shape"]))))
    done_steps = Poller(url, [(r.id, steps) for (_, r), steps in zip(batch, plan["batch_steps"])], began)
    done_steps.start()
    interactive, measured = [], plan["batch"]
    try:
        for i, at in enumerate(plan["arrivals_s"]):
            time.sleep(max(0.0, began + at - time.time()))
            sent = time.time()
            interactive.append((sent, generate.apply_async(kwargs=request(f"preview {i}", INTERACTIVE_STEPS,
                                                                              "interactive", 1000 + i, plan["shape"]))))
        answers = [(sent, r.get(timeout=600)) for sent, r in interactive]
        done = [(sent, r.get(timeout=900)) for sent, r in batch[:measured]]
    finally:
        done_steps.stop()
    waits = [res["timings"] for _, res in answers]
    if not backlog:
        return {"waits_s": [t["queued_s"] for t in waits]}
    completed = [sent + res["timings"]["queued_s"] + res["timings"]["total_s"] - began for sent, res in done]
    purge(client, queue)
    for _, r in batch[measured:]:  # running ones stop at their next step; the purged ones never start
        cancel_request(r.id)
    ids = [r.id for _, r in batch + interactive]
    counts = dict(zip(ids, (int(n or 0) for n in client.mget([PREEMPTIONS_KEY + i for i in ids]))))
    set_steps = sum(plan["batch_steps"][:measured])
    return {
        "waits_s": [t["queued_s"] for t in waits],
        "interactive_inference_s": [t["inference_s"] for t in waits],
        # Each run's batch figures count the same interactive work only if all of it is done before them.
        "interactive_done_s": max(sent + t["queued_s"] + t["total_s"] - began for (sent, _), t in zip(answers, waits)),
        "completed_s": completed,
        "makespan_s": max(completed),
        "set_steps_done_s": next((t for t, n in done_steps.timeline if n >= set_steps), None),
        "batch_steps_done": done_steps.timeline[::4],  # (s since the first batch send, steps) every second
        "preemptions": sum(counts.values()),
        "preemptions_of_measured": sum(counts[r.id] for _, r in batch[:measured]),
        "preempted_requests": sum(1 for n in counts.values() if n),
        "max_per_request": max(counts.values()),
        "interactive_preempted": sum(counts[r.id] for _, r in interactive),
        # Interactive requests are never preempted: their steps, as the replicas ran them (the denoising loop's time
        # where the model reports it).
        "step_s_measured": statistics.mean(t.get("dit_s") or t["inference_s"] for t in waits) / INTERACTIVE_STEPS,
        "checkpoints_left": len(list(client.scan_iter(CHECKPOINT_KEY + "*"))),
    }


def warm_preemption(client, shape: dict, steps: int) -> None:
    """One request on each replica preempted at its step 2 and resumed (by hand: `replicadp preempt`, which needs
    no policy), in both runs: a pool child's first checkpoint imports torch (Checkpoint.to_bytes, from_bytes),
    over a second here inside the step that stops, which a real model's replica has loaded long before."""
    from client.api import preempt_request
    from replicadp_tasks import generate

    warm = [generate.apply_async(kwargs=request(f"warm preempted {i}", steps, "normal", 100 + i, shape)) for i in range(2)]
    for r in warm:
        deadline = time.monotonic() + 60
        while not (step_of(client.get(TASK_META + r.id)) or 0) >= 2:
            if time.monotonic() > deadline:
                raise TimeoutError(f"warm-up request {r.id} did not reach step 2")
            time.sleep(0.05)
        preempt_request(r.id)
    for r in warm:
        r.get(timeout=120)
    assert all(int(client.get(PREEMPTIONS_KEY + r.id) or 0) == 1 for r in warm), "warm-up requests not preempted"


def step_of(raw: bytes | None) -> int | None:
    """The step a running request's record (its Progress) reports, if it reports one."""
    result = json.loads(raw).get("result") if raw else None
    return result.get("step") if isinstance(result, dict) else None


class Poller:
    """Batch steps done so far, every POLL_S from a thread: each batch request's highest step reported (its
    Progress; all its steps once it succeeded), summed. A preempted request goes on from its step, so the sum
    is the batch work done, wherever it ran: the makespan without the luck of which request ends last."""

    POLL_S = 0.25

    def __init__(self, url: str, requests: list[tuple[str, int]], began: float):
        self.redis, self.requests, self.began = connection.client(url), requests, began
        self.reached = {task_id: 0 for task_id, _ in requests}
        self.timeline: list[tuple[float, int]] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.done.set()
        self.thread.join()

    def run(self) -> None:
        keys = [TASK_META + task_id for task_id, _ in self.requests]
        while True:
            now = time.time()
            try:
                records = self.redis.mget(keys)
            except redis.RedisError:  # a slow read: the next poll counts the same steps
                records = [None] * len(keys)
            for (task_id, steps), raw in zip(self.requests, records):
                done = raw is not None and json.loads(raw).get("status") == "SUCCESS"
                self.reached[task_id] = max(self.reached[task_id], steps if done else step_of(raw) or 0)
            self.timeline.append((round(now - self.began, 3), sum(self.reached.values())))
            if self.done.wait(self.POLL_S):
                return


# --- checkpoint: in one process, on the tiny models (`--phase checkpoint`) ------------------------------------------

def timed(fn, repeats: int = REPEATS) -> tuple[float, object]:
    """The median seconds of `repeats` calls of fn, and its last value."""
    times, value = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        value = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), value


def costs(client, ck, name: str) -> dict:
    """Bytes of `ck`, and the medians of: to_bytes, from_bytes, Redis write (as delivery.preempted) and read."""
    from replicadp_tasks.model.checkpoint import Checkpoint

    save_s, data = timed(ck.to_bytes)
    load_s, _ = timed(lambda: Checkpoint.from_bytes(data))
    key = CHECKPOINT_KEY + name

    def write() -> None:
        client.pipeline().hset(key, mapping={"input_key": "x", "step": ck.step, "total": ck.total, "data": data}) \
            .expire(key, 600).execute()
    write_s, _ = timed(write)
    read_s, got = timed(lambda: client.hgetall(key))
    assert got[b"data"] == data
    client.delete(key)
    return {"bytes": len(data), "to_bytes_s": save_s, "from_bytes_s": load_s, "redis_write_s": write_s,
            "redis_read_s": read_s}


def phase_checkpoint(url: str) -> dict:
    import torch

    from replicadp_tasks.contract import RequestPreempted, validate_request
    from replicadp_tasks.model import ModelOptions, PipelineHolder
    from replicadp_tasks.settings import SETTINGS

    client = connection.client(url, socket_timeout=60)
    holders, rows, fixed = {}, [], set()
    for model, width, height, frames in MEASURED:
        if model not in holders:
            holders[model] = PipelineHolder(ModelOptions(model, model_cache=SETTINGS.model_cache, threads=2))
            holders[model].load()
        h = holders[model]
        req = validate_request({"prompt": "a heron lands", "seed": 7, "width": width, "height": height,
                                "num_frames": frames, "num_inference_steps": 8}, h.accepts)

        def preempt(step: int, total: int) -> None:
            if step == 2:
                raise RequestPreempted(f"at step {step} of {total}")
        try:
            h.generate(req, on_step=preempt)
            raise AssertionError("not preempted")
        except RequestPreempted as exc:
            ck = exc.checkpoint
        latent = latent_bytes(width, height, frames, *LATENT_DIMS[model])
        assert ck.latents.numel() * 4 == latent, (tuple(ck.latents.shape), latent)
        row = {"model": model, "size": f"{width}x{height}x{frames}", "latent_shape": list(ck.latents.shape),
               "latent_bytes": latent, **costs(client, ck, f"{model}-{width}x{height}x{frames}")}
        fixed.add(row["bytes"] - SOLVER_TENSORS * latent)
        rows.append(row)
    assert len(fixed) == 1, f"the checkpoints' size is not 4 L + one constant: {sorted(fixed)}"
    fixed = fixed.pop()
    # The A14B's state at its size: tiny-a14b's last checkpoint, its latent-shaped tensors of the A14B's shape.
    big = None
    for name, width, height, frames, z_dim, spatial in COMPUTED:
        latent = latent_bytes(width, height, frames, z_dim, spatial)
        row = {"model": name, "size": f"{width}x{height}x{frames}", "latent_bytes": latent,
               "computed_bytes": SOLVER_TENSORS * latent + fixed,
               "latent_shape": [1, z_dim, (frames - 1) // 4 + 1, height // spatial, width // spatial]}
        if z_dim == 16:
            shape, g = row["latent_shape"], torch.Generator().manual_seed(0)
            state = dict(ck.scheduler, model_outputs=[torch.randn(shape, generator=g) for _ in range(2)],
                         last_sample=torch.randn(shape, generator=g))
            big = replace(ck, latents=torch.randn(shape, generator=g), scheduler=state)
            row |= {"built": True, **costs(client, big, name)}
        rows.append(row)
    return {"fixed_bytes": fixed, "rows": rows, "torch": torch.__version__}


def run_phase(name: str, url: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--phase", name], env={**os.environ, "REDIS_URL": url},
                         capture_output=True, text=True, timeout=900, check=False)
    if out.returncode:
        raise SystemExit(f"phase {name} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# --- the command ----------------------------------------------------------------------------------------------------

@click.command()
@click.option("--step-s", default=0.5, show_default=True, help="Seconds per denoising step (synthetic:SECONDS).")
@click.option("--batch", default=8, show_default=True, help="Batch requests measured (the makespan's set).")
@click.option("--extra", default=4, show_default=True, help="Batch requests after them: replicas never idle.")
@click.option("--arrivals", default=16, show_default=True, help="Interactive requests.")
@click.option("--gap", default=4.0, show_default=True, help="Mean seconds between interactive arrivals.")
@click.option("--lead", default=3.0, show_default=True, help="Seconds from the first batch send to the arrivals.")
@click.option("--after", type=float, multiple=True, default=[0.0], show_default=True,
              help="REPLICADP_PREEMPT_AFTER_S of an `on` run (repeat: one run each, after the `off` one).")
@click.option("--max-preemptions", type=int, multiple=True, default=[2], show_default=True,
              help="REPLICADP_MAX_PREEMPTIONS of an `on` run (repeat: one run each, with each --after).")
@click.option("--model", default="synthetic", show_default=True,
              help="The replicas' model: the synthetic backend (--step-s), or a real one (e.g. tiny) at --size.")
@click.option("--size", default="128x128x9", show_default=True,
              help="WIDTHxHEIGHTxFRAMES of a real --model's requests.")
@click.option("--threads", default=1, show_default=True, help="CPU threads per replica of a real --model.")
@click.option("--seed", default=58, show_default=True)
@click.option("--figures", default="serving,checkpoint", show_default=True, help="Which measurements to run.")
@click.option("--json", "out", type=click.Path(dir_okay=False, path_type=Path), help="Write the figures here.")
@click.option("--png", type=click.Path(dir_okay=False, path_type=Path),
              help="Draw the waits' CDFs and the batch steps done here.")
@click.option("--logs", type=click.Path(file_okay=False, path_type=Path), help="Keep the replicas' logs here.")
@click.option("--phase", hidden=True)
def main(step_s, batch, extra, arrivals, gap, lead, after, max_preemptions, model, size, threads, seed, figures, out,
         png, logs, phase):
    if phase:  # a process of run_phase: its result as the last line of stdout
        print(json.dumps(PHASES[phase](os.environ["REDIS_URL"])))
        return
    for name in (PREEMPT_ENV, MAX_ENV):  # the `off` replicas inherit this environment
        os.environ.pop(name, None)
    console = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 160)
    rng = random.Random(seed)
    at, arrivals_s = lead, []
    for _ in range(arrivals):
        arrivals_s.append(round(at, 3))
        at += rng.expovariate(1 / gap)
    if model == "synthetic":
        shape, served = SHAPE, f"synthetic:{step_s * REFERENCE_WORK / math.prod(SHAPE.values()):g}"
        warm_steps = 8
    else:  # its step time is measured, not set; its warm-up is long enough to be preempted whatever a step takes
        width, height, frames = (int(n) for n in size.split("x"))
        shape, served, step_s = {"height": height, "width": width, "num_frames": frames}, model, None
        warm_steps = BATCH_STEPS[1]
    report = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
              "date": time.strftime("%Y-%m-%d"), "step_s": step_s, "model": served, "shape": shape, "warm_steps": warm_steps,
              "after_s": list(after), "max_preemptions": list(max_preemptions), "seed": seed, "batch": batch,
              "extra": extra, "gap_s": gap,
              "interactive_steps": INTERACTIVE_STEPS,
              "batch_steps": [rng.randint(*BATCH_STEPS) for _ in range(batch + extra)], "arrivals_s": arrivals_s,
              "runs": {}, "checkpoint": None}
    started = time.time()
    run_dir = Path(tempfile.mkdtemp(prefix="replicadp-preemption-"))
    try:
        server = EmbeddedServer(run_dir / "redis")
        url = server.start()
        try:
            from client.api import use_redis

            use_redis(url)
            runs = [("alone", {}), ("off", {}), *((f"on, {s:g} s, max {m}", {PREEMPT_ENV: f"{s:g}",
                                                                           MAX_ENV: str(m)})
                                                  for s in after for m in max_preemptions)]
            for mode, policy in runs if "serving" in figures else ():
                env = {"OUTPUT_DIR": str(run_dir / "outputs"), **policy}
                t0 = time.time()
                with Replicas(2, redis_url=url, model=served, env=env,
                              threads=threads if model != "synthetic" else None,
                              log_path=run_dir / f"{mode.replace(', ', '-').replace(' ', '')}.log"):
                    report["runs"][mode] = serve(url, report, backlog=mode != "alone")
                report["runs"][mode]["wall_s"] = round(time.time() - t0, 1)
                console.print(f"preemption {mode}: done in {report['runs'][mode]['wall_s']} s")
            if "checkpoint" in figures:
                report["checkpoint"] = run_phase("checkpoint", url)
        finally:
            server.stop()
    finally:
        if logs:
            logs.mkdir(parents=True, exist_ok=True)
            for log in run_dir.glob("*.log"):
                shutil.copy(log, logs / log.name)
        shutil.rmtree(run_dir, ignore_errors=True)
    report["wall_s"] = round(time.time() - started, 1)
    if report["step_s"] is None and report["runs"]:  # a real model: the steps as its interactive requests ran them
        report["step_s"] = statistics.median(run["step_s_measured"] for mode, run in report["runs"].items()
                                             if mode != "alone")
    summarize(report)
    print_report(console, report)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))
    if png and report["runs"]:
        draw(report, png, console)


PHASES = {"checkpoint": phase_checkpoint}


def summarize(r: dict) -> None:
    """Each run's percentiles, and of what each request waited beyond its wait in the `alone` run (the same
    arrivals with no batch work: they wait for each other on 2 replicas, whatever the policy); the issue's goals:
    p99 <= 2 steps + 1 s on (of the waits, and of the waits beyond alone's); makespan cost <= 2%."""
    step, alone = r["step_s"], r["runs"].get("alone")
    for run in r["runs"].values():
        waits = run["waits_s"]
        run |= {"wait_p50_s": statistics.median(waits), "wait_p99_s": percentile(waits, 99), "wait_max_s": max(waits)}
        if alone:
            beyond = [w - a for w, a in zip(waits, alone["waits_s"])]
            run |= {"beyond_alone_s": beyond, "beyond_p50_s": statistics.median(beyond),
                    "beyond_p99_s": percentile(beyond, 99)}
    first_on = next((mode for mode in r["runs"] if mode.startswith("on")), None)
    if "off" in r["runs"] and first_on:
        off, on = r["runs"]["off"], r["runs"][first_on]
        r["goals"] = {"run": first_on, "p99_limit_s": 2 * step + 1, "p99_met": on["wait_p99_s"] <= 2 * step + 1,
                      "beyond_p99_met": on.get("beyond_p99_s", math.inf) <= 2 * step + 1,
                      "makespan_cost_pct": 100 * (on["makespan_s"] / off["makespan_s"] - 1),
                      "set_steps_cost_pct": 100 * (on["set_steps_done_s"] / off["set_steps_done_s"] - 1)}
        r["goals"]["makespan_met"] = r["goals"]["makespan_cost_pct"] <= 2


def vs_off(r: dict, mode: str, key: str) -> str:
    off = r["runs"].get("off")
    return "-" if not mode.startswith("on") or not off else f"{100 * (r['runs'][mode][key] / off[key] - 1):+.1f}%"


def print_report(console: Console, r: dict) -> None:
    step = r["step_s"]
    if r["runs"]:
        k, lo, hi = r["batch"], min(r["batch_steps"]), max(r["batch_steps"])
        size = "x".join(str(r["shape"][k]) for k in ("width", "height", "num_frames"))
        t = Table(title=f"2 replicas of {r['model']} ({step:.3g} s a step at {size}), {k + r['extra']} "
                        f"batch renders of {lo}-{hi} steps; {len(r['arrivals_s'])} interactive requests of "
                        f"{INTERACTIVE_STEPS} steps at exponential gaps (mean {r['gap_s']:g} s); makespan: the "
                        f"first {k} batch requests complete; their steps done: as many batch steps done, by any; "
                        f"alone: the interactive requests with no batch work; beyond alone: each request's wait "
                        f"less its wait alone; on, S s, max M: {PREEMPT_ENV}=S, {MAX_ENV}=M")
        for col in ("preemption", "wait p50", "p99", "p50 / step", "p99 / step", "max", "beyond alone p50", "p99",
                    f"makespan ({k})", "vs off", "their steps done", "vs off", "preemptions (of the set)",
                    "step, measured"):
            t.add_column(col, justify="right")
        for mode, run in r["runs"].items():
            batch = [f"{run['makespan_s']:.1f} s", vs_off(r, mode, "makespan_s"), f"{run['set_steps_done_s']:.1f} s",
                     vs_off(r, mode, "set_steps_done_s"), f"{run['preemptions']} ({run['preemptions_of_measured']})",
                     f"{run['step_s_measured']:.3f} s"] if mode != "alone" else ["-"] * 6
            beyond = [f"{run[k]:.2f} s" if k in run else "-" for k in ("beyond_p50_s", "beyond_p99_s")]
            t.add_row(mode, f"{run['wait_p50_s']:.2f} s", f"{run['wait_p99_s']:.2f} s",
                      f"{run['wait_p50_s'] / step:.1f}", f"{run['wait_p99_s'] / step:.1f}",
                      f"{run['wait_max_s']:.2f} s", *(beyond if mode != "alone" else ["-", "-"]), *batch)
        console.print(t)
        for mode, run in r["runs"].items():
            if mode != "alone" and run["interactive_done_s"] > min(run["makespan_s"], run["set_steps_done_s"]):
                console.print(f"[yellow]{mode}: an interactive request ended at {run['interactive_done_s']:.1f} s, "
                              "after the batch figures: they count less interactive work than the other run's")
        if "goals" in r:
            g = r["goals"]
            console.print(f"goals ({g['run']}): p99 with preemption <= {g['p99_limit_s']:g} s (2 steps + 1 s): "
                          f"{'met' if g['p99_met'] else 'NOT met'}, beyond alone "
                          f"{'met' if g['beyond_p99_met'] else 'NOT met'}; makespan cost "
                          f"{g['makespan_cost_pct']:+.1f}% "
                          f"(<= 2%): {'met' if g['makespan_met'] else 'NOT met'}; the set's steps done "
                          f"{g['set_steps_cost_pct']:+.1f}%")
    if r["checkpoint"]:
        c = r["checkpoint"]
        t = Table(title=f"a preempted request's checkpoint (UniPC, step 2 of 8): bytes = 4 L + {c['fixed_bytes']} "
                        "(L: the fp32 latents' bytes); medians of 3; Redis: the embedded server, appendfsync always")
        for col in ("model", "WxHxF", "latents", "bytes", "4 L + fixed", "to_bytes", "from_bytes",
                    "Redis HSET", "HGETALL"):
            t.add_column(col, justify="left" if col in ("model", "WxHxF", "latents") else "right")
        for row in c["rows"]:
            computed = SOLVER_TENSORS * row["latent_bytes"] + c["fixed_bytes"]
            measured = "bytes" in row and not row.get("built")
            cells = [f"{row[k] * 1e3:.1f} ms" if k in row else "-"
                     for k in ("to_bytes_s", "from_bytes_s", "redis_write_s", "redis_read_s")]
            name = row["model"] + (" (computed; timed on a state of its shape)" if row.get("built") else
                                   " (computed)" if not measured else "")
            t.add_row(name, row["size"], "x".join(map(str, row["latent_shape"])),
                      f"{row['bytes'] / 1e6:.3f} MB" if measured else "-", f"{computed / 1e6:.3f} MB", *cells)
        console.print(t)
    console.print(f"wall time: {r['wall_s']:.0f} s")


def draw(r: dict, path: Path, console: Console) -> None:
    try:
        import matplotlib
    except ImportError:
        console.print("matplotlib is not installed: no figure; the waits are in the JSON")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (waits_ax, work_ax) = plt.subplots(1, 2, figsize=(11, 4.8))
    for color, (mode, run) in zip(plt.rcParams["axes.prop_cycle"].by_key()["color"], r["runs"].items()):
        waits = sorted(run["waits_s"])
        name = "no batch work (alone)" if mode == "alone" else f"preemption {mode}"
        waits_ax.step(waits, [(i + 1) / len(waits) for i in range(len(waits))], where="post", color=color,
                      label=f"{name}: p50 {run['wait_p50_s']:.2f} s, p99 {run['wait_p99_s']:.2f} s")
        if mode == "alone":
            continue
        t, n = zip(*run["batch_steps_done"])
        work_ax.plot(t, n, color=color, label=f"{name}: the set's steps done at {run['set_steps_done_s']:.1f} s")
    if "goals" in r:
        waits_ax.axvline(r["goals"]["p99_limit_s"], color="grey", linestyle="--", label="goal: 2 steps + 1 s")
    waits_ax.set_xscale("log")
    waits_ax.set_xlabel("interactive request's wait before it starts (s, log scale)")
    waits_ax.set_ylabel("fraction of requests")
    waits_ax.set_title(f"{len(r['arrivals_s'])} interactive requests behind batch renders, 2 replicas, "
                       f"{r['step_s']:g} s steps", fontsize=9)
    work_ax.axhline(sum(r["batch_steps"][:r["batch"]]), color="grey", linestyle="--",
                    label=f"the first {r['batch']} batch requests' steps")
    work_ax.set_xlabel("seconds since the first batch send")
    work_ax.set_ylabel("batch steps done (all batch requests)")
    work_ax.set_title("batch work done", fontsize=9)
    for ax in (waits_ax, work_ax):  # below the plots: the curves fill both corners
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
