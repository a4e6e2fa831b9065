#!/usr/bin/env bash
# Every figure of docs/benchmarks.md, in one run on a quiet machine. Outputs under bench-results/.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
RDP=${RDP:-.venv/bin/replicadp}
export HF_HUB_OFFLINE=1
unset REDIS_URL
mkdir -p bench-results
# 1. Overhead: tiny real model, plain loop against one replica, 1 thread each.
$PY bench/overhead.py --requests 30 --rounds 5 --size 128x128 --num-frames 17 --steps 8 --out bench-results/overhead.json
$PY bench/overhead.py --requests 12 --rounds 5 --size 256x256 --num-frames 17 --steps 8 --out bench-results/overhead-256.json
# 1b. The serving cost alone: synthetic:0 (no compute, frames still encoded), one busy replica, 1 and 30 steps.
for steps in 1 30; do
  $RDP sweep --replicas 1 --model synthetic:0 --size 128x128 --num-frames 17 --steps $steps --num-requests 100 \
    --concurrency 2 --out bench-results/serving-cost-$steps-steps
done
# 2. Scaling: synthetic replicas, 2 s requests (synthetic:48.75 at 128x128, 33 frames, 30 steps = 2.0 s).
$RDP sweep --replicas 1,2,4,8 --model synthetic:48.75 --size 128x128 --num-frames 33 --steps 30 \
  --num-requests 48 --out bench-results/scaling
# 3. Mixed sizes: frames from {17, 49, 81}, 0.4-2 s requests, all queued at once.
$PY bench/mixed_sizes.py --replicas 2,4 --requests 24 --seconds 5 --size 256x256 --out bench-results/mixed.json
# 4. Dispatch: idle replicas, one request at a time; queue_wait = submit to the replica starting it.
$RDP sweep --replicas 2 --model synthetic:0 --size 64x64 --num-frames 9 --steps 4 --num-requests 100 \
  --concurrency 1 --out bench-results/dispatch
# 5. The real tiny model on 2 cores: 1 replica vs 2, one thread each.
$RDP sweep --replicas 1,2 --model tiny --size 128x128 --num-frames 17 --steps 8 --num-requests 24 \
  --threads 1 --out bench-results/tiny
# 7. MP4 encoding at 832x480x33: before and after the AVX-512 cap, and mbtree=0 (replicadp_tasks/outputs/video.py).
$PY bench/encode.py --repeats 7 --out bench-results/encode.json
# 8. Scheduling: priorities, round robin across users and longest-first batches against one FIFO list.
$PY bench/scheduling.py --repeats 3 --out bench-results/scheduling.json
# 9. Step caches against the exact path: the tiny model, 128x128x17, 30 steps, the paths in turn per input.
$PY bench/step_cache.py --requests 6 --out bench-results/step-cache-cpu.json
# 10. The embedded server's `appendfsync always`: what the fsync adds to a write (docs/benchmarks.md, section 1).
$PY bench/fsync.py --writes 2000 --rounds 5 --out bench-results/fsync.json
