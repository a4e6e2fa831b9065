"""scripts/gpu_check.sh, rehearsed on the CPU: the GPU check's whole sequence with a tiny random model."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# The script starts replicas of its own and takes minutes.
pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parent.parent
STATE_DIR = re.compile(r"/tmp/replicadp-gpu-check\.\w+")  # the folder each run of the script makes


def started_by_the_script(out: Path) -> list[str]:
    """PIDs of the processes that the run writing to `out` started: OUT is in the environment of all of them,
    and of no other run's on this machine."""
    mark = f"OUT={out}".encode()
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if mark in proc.joinpath("environ").read_bytes().split(b"\0"):
                pids.append(proc.name)
        except OSError:  # gone, or not ours
            pass
    return pids


def left_behind(run: subprocess.CompletedProcess) -> list[str]:
    """The run's state folders (as its output names them) that still exist; an error if it named none."""
    dirs = set(STATE_DIR.findall(run.stdout + run.stderr))
    assert dirs, "the run never named its state folder"
    return [d for d in dirs if Path(d).exists()]


def run_check(tmp_path: Path, **overrides: str) -> tuple[subprocess.CompletedProcess, Path]:
    """scripts/gpu_check.sh on the CPU with the tiny architecture; its output folder."""
    out = tmp_path / "out"
    env = {**os.environ, "DEVICE": "cpu", "MODEL": "random:tiny-wan2.2-ti2v", "SIZE": "64x64", "FRAMES": "5",
           "STEPS": "2", "REQUESTS": "3", "OUT": str(out),
           # The memory step on the two-expert stand-in; 4 steps run 3 + 1 on its experts, so `expert` swaps them.
           "MEMORY_MODEL": "random:tiny-wan2.2-t2v-a14b", "MEMORY_SIZE": "64x64", "MEMORY_FRAMES": "5",
           "MEMORY_STEPS": "4", "MEMORY_REQUESTS": "1",
           "FEWSTEP_REQUESTS": "1",  # the few-step step on MODEL: exact at STEPS against the 4-step recipe
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", **overrides}  # this venv's python3
    for name in ("REDIS_URL", "REPLICADP_ATTENTION", "REPLICADP_COMPILE"):
        env.pop(name, None)
    run = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], env=env, capture_output=True, text=True,
                         timeout=600)
    return run, out


def test_gpu_check_rehearses_on_the_cpu(tmp_path):
    """Without a GPU (DEVICE=cpu, random:tiny-wan2.2-ti2v), the check's first command on a device
    (MEMORY_REQUESTS=0 FEWSTEP_REQUESTS=0) runs end to end: the kernels step (each attention backend, then compiled
    blocks), the embedded server, one replica recording the baseline, one without deterministic kernels (its cost
    printed), two replicas checked against the baseline, the step caches, the summary. It exits 0, the replicas use
    the fastest backend the kernels step found, its reports hold the figures the GPU run prints (latency,
    videos/min, peak memory per replica, isolation, each step cache against the exact path), and it stops what it
    started. The second command's steps are rehearsed by test_gpu_check_runs_the_memory_and_few_step_steps_alone."""
    run, out = run_check(tmp_path, MEMORY_REQUESTS="0", FEWSTEP_REQUESTS="0")
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    kernels = json.loads((out / "kernels.json").read_text())
    ran = {r["variant"].split("=", 1)[1] for r in kernels["rows"] if r["seconds_per_pass"]}
    assert "native" in ran and kernels["fastest_backend"] in ran
    assert any(r["note"].startswith("RuntimeError") for r in kernels["rows"])  # flash-attn is not installed here
    assert kernels["compile"]["seconds_per_pass"] > 0 and kernels["compile"]["compile_s"] > 0
    assert f"replicas: REPLICADP_ATTENTION={kernels['fastest_backend']} " in run.stdout
    one, two = (json.loads((out / f"{n}.json").read_text()) for n in ("one", "two"))
    assert one["completed"] == two["completed"] == 3 and one["replicas"] == 1 and two["replicas"] == 2
    assert two["isolation"]["passed"] and two["isolation"]["matched"] == 3
    assert all(r["peak_memory_gib"] > 0 for r in two["per_replica"].values())
    assert one["dit_tflops_per_s"] > 0 and one["mfu"] is None  # no MFU against a GPU's peak on a CPU
    assert "PASS (3 matched, 0 mismatched)" in run.stdout
    fast = json.loads((out / "fast.json").read_text())
    assert fast["completed"] == 3 and fast["label"] == "1 replica, nondeterministic"
    assert "deterministic kernels (REPLICADP_DETERMINISTIC=1, the default) cost" in run.stdout
    assert (out / "replicas.log").exists()
    caches = json.loads((out / "step-cache.json").read_text())
    assert [r["path"] for r in caches["rows"]] == ["exact", "first-block", "mag", "taylorseer", "pab"]
    assert caches["model"] == "random:tiny-wan2.2-ti2v" and len(caches["mag_ratios"]) == 2
    assert all(r["request_s"] > 0 and 0 <= r["blocks_skipped"] < 1 for r in caches["rows"])
    assert "step caches: random:tiny-wan2.2-ti2v on cpu" in run.stdout
    assert not (out / "memory.json").exists() and not (out / "fewstep.json").exists()
    assert started_by_the_script(out) == [] and left_behind(run) == []


def test_gpu_check_goes_on_when_the_kernels_step_is_cut_short(tmp_path):
    """A kernels step past KERNELS_TIMEOUT (1 s here: it is killed while importing torch) costs the check only
    its kernel figures: it says so, the replicas run on the default attention backend and pass the isolation
    check, and the exit status is 1 (something was not measured). FAST_REQUESTS=0, CACHE_REQUESTS=0,
    MEMORY_REQUESTS=0 and FEWSTEP_REQUESTS=0 skip the nondeterministic run, the step caches, the memory options and
    the few-step step (rehearsed by the tests beside it)."""
    run, out = run_check(tmp_path, KERNELS_TIMEOUT="1", REQUESTS="2", FAST_REQUESTS="0", CACHE_REQUESTS="0",
                         MEMORY_REQUESTS="0", FEWSTEP_REQUESTS="0")
    assert run.returncode == 1, run.stdout[-4000:] + run.stderr[-4000:]
    assert not (out / "fast.json").exists() and not (out / "step-cache.json").exists()
    assert not (out / "memory.json").exists() and "memory options" not in run.stdout
    assert not (out / "fewstep.json").exists() and "few-step" not in run.stdout
    assert "gpu_check [" in run.stdout and "deterministic kernels off" not in run.stdout
    assert "fast: no report" in run.stdout
    assert "the kernels step failed or ran past 1 s" in run.stderr
    assert "replicas: REPLICADP_ATTENTION=native (default) " in run.stdout
    two = json.loads((out / "two.json").read_text())
    assert two["completed"] == 2 and two["isolation"]["passed"]
    assert "PASS (2 matched, 0 mismatched)" in run.stdout
    assert started_by_the_script(out) == [] and left_behind(run) == []


def test_gpu_check_runs_the_memory_and_few_step_steps_alone(tmp_path):
    """ONLY_MEMORY=1, the check's second command on a device (its 10 minutes a command hold either half, not
    both): the memory step alone, every option on the two-expert stand-in with frames equal to none's, few-step
    serving against the exact model (each path's seconds per video and FLOPs), then the summary; no kernels step, no
    replica, no serving table. It exits 0 and stops what it started."""
    run, out = run_check(tmp_path, ONLY_MEMORY="1")
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert sorted(p.name for p in out.iterdir()) == ["fewstep.json", "memory.json"]
    assert "gpu_check [" in run.stdout and "kernels" not in run.stdout and "no report" not in run.stdout
    mem = json.loads((out / "memory.json").read_text())
    assert mem["model"] == "random:tiny-wan2.2-t2v-a14b" and mem["requests"] == 1
    assert [r["option"] for r in mem["rows"]] == ["none", "expert", "model", "group"]
    assert all(r["skipped"] is None and r["request_s"] > 0 and r["same_as_none"] == 1 for r in mem["rows"])
    assert "memory options (random:tiny-wan2.2-t2v-a14b, 64x64x5, 4 steps):" in run.stdout
    assert re.search(r"group +p50 request [0-9.]+ s, peak [0-9.]+ GiB, same frames as none: 1/1", run.stdout)
    few = json.loads((out / "fewstep.json").read_text())
    assert few["model"] == "random:tiny-wan2.2-ti2v" and few["requests"] == 1
    exact, fast = few["rows"]
    assert (exact["path"], exact["steps"], exact["guidance_scale"]) == ("exact", 2, 5.0)  # STEPS, the model's
    assert (fast["path"], fast["steps"], fast["guidance_scale"]) == ("few-step", 4, 1.0)
    assert all(r["request_s"] > 0 and r["dit_s"] > 0 for r in few["rows"])
    # A pass a step, two with CFG: at the reference's 30 steps 15x fewer FLOPs; at the rehearsal's STEPS=2, as many.
    assert exact["dit_flops"] / fast["dit_flops"] == pytest.approx(exact["steps"] * 2 / fast["steps"])
    assert few["speedup"]["flops"] == pytest.approx(exact["steps"] * 2 / fast["steps"])
    assert "few-step serving: random:tiny-wan2.2-ti2v on cpu" in run.stdout
    assert re.search(r"few-step \(random:tiny-wan2\.2-ti2v, 64x64x5\): [0-9.]+ s/video exact \(2 steps, guidance 5\) "
                     r"vs [0-9.]+ few-step \(4 steps, guidance 1\): [0-9.]+x; DiT MFU [0-9.]+% vs [0-9.]+%; "
                     r"DiT FLOPs 1\.0x fewer", run.stdout)
    assert started_by_the_script(out) == [] and left_behind(run) == []
