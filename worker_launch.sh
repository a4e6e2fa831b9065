#!/usr/bin/env bash
# Start one replica per GPU (or per group of GPUS_PER_REPLICA GPUs), each a Celery worker holding one
# resident pipeline, each supervised: a replica that dies is restarted with the same name and devices, with
# backoff. Ctrl-C or SIGTERM stops them all. Extra arguments go to `celery worker`.
#
#   NUM_REPLICAS=4 DEVICES=0,1,2,3 REPLICADP_MODEL=Wan-AI/Wan2.2-TI2V-5B-Diffusers ./worker_launch.sh
#   NUM_REPLICAS=2 DEVICES=cpu THREADS_PER_REPLICA=1 REPLICADP_MODEL=tiny ./worker_launch.sh
#
# NUM_REPLICAS         replicas to start (default 1)
# FIRST_REPLICA        the first replica's number: replica<FIRST_REPLICA>@host, ... (default 0); a second launcher
#                      on the host, for another model, numbers its replicas after the first one's
# DEVICES              comma-separated GPU ids, or "cpu" (default: every GPU nvidia-smi lists, else cpu)
# GPUS_PER_REPLICA     GPUs per replica; DEVICES must hold NUM_REPLICAS * GPUS_PER_REPLICA ids (default 1)
# THREADS_PER_REPLICA  CPU threads per replica on cpu (default: cores / NUM_REPLICAS, at least 1)
# SHARE_GPUS           1: let DEVICES list a GPU more than once, for replicas that share it (benchmarks on one
#                      GPU: DEVICES=0,0); each replica then holds its own copy of the model on it
# CELERY               the celery command (default: celery)
set -euo pipefail

NUM_REPLICAS=${NUM_REPLICAS:-1}
FIRST_REPLICA=${FIRST_REPLICA:-0}
GPUS_PER_REPLICA=${GPUS_PER_REPLICA:-1}
CELERY=${CELERY:-celery}

# The launcher's own lines, on stderr: text, or with REPLICADP_LOG_FORMAT=json one JSON object each, as the
# replicas write theirs (replicadp_tasks/logs.py). say LEVEL MESSAGE
say() {
  if [[ ${REPLICADP_LOG_FORMAT:-text} == json ]]; then
    local message=${2//\\/\\\\}
    message=${message//\"/\\\"}
    printf '{"time": "%s", "level": "%s", "logger": "worker_launch.sh", "message": "%s", "role": "launcher", "pid": %d}\n' \
      "$(date -u +%Y-%m-%dT%H:%M:%S.%3N+00:00)" "$1" "$message" "$BASHPID" >&2
  else
    echo "worker_launch.sh: $2" >&2
  fi
}
die() { say ERROR "$*"; exit 2; }

[[ $NUM_REPLICAS =~ ^[1-9][0-9]*$ ]] || die "NUM_REPLICAS=$NUM_REPLICAS: must be a positive integer"
[[ $FIRST_REPLICA =~ ^(0|[1-9][0-9]*)$ ]] || die "FIRST_REPLICA=$FIRST_REPLICA: must be a number from 0"
[[ $GPUS_PER_REPLICA =~ ^[1-9][0-9]*$ ]] || die "GPUS_PER_REPLICA=$GPUS_PER_REPLICA: must be a positive integer"

if [[ -z ${DEVICES:-} ]]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    DEVICES=$(nvidia-smi --query-gpu=index --format=csv,noheader | paste -sd, -)
  else
    DEVICES=cpu
  fi
fi

if [[ $DEVICES == cpu ]]; then
  cores=$(nproc)
  THREADS_PER_REPLICA=${THREADS_PER_REPLICA:-$(( cores / NUM_REPLICAS > 0 ? cores / NUM_REPLICAS : 1 ))}
  [[ $THREADS_PER_REPLICA =~ ^[1-9][0-9]*$ ]] || die "THREADS_PER_REPLICA=$THREADS_PER_REPLICA: must be a positive integer"
else
  IFS=, read -ra ids <<< "$DEVICES"
  for id in "${ids[@]}"; do
    [[ $id =~ ^[0-9]+$ ]] || die "DEVICES=$DEVICES: '$id' is not a GPU index (use e.g. 0,1,2,3 or cpu)"
  done
  need=$(( NUM_REPLICAS * GPUS_PER_REPLICA ))
  (( ${#ids[@]} == need )) || die "DEVICES=$DEVICES lists ${#ids[@]} GPU(s); NUM_REPLICAS=$NUM_REPLICAS x GPUS_PER_REPLICA=$GPUS_PER_REPLICA needs $need"
  dupes=$(printf '%s\n' "${ids[@]}" | sort | uniq -d | paste -sd, -)
  [[ -z $dupes || ${SHARE_GPUS:-0} == 1 ]] || die "DEVICES=$DEVICES lists GPU $dupes more than once (SHARE_GPUS=1 allows it)"
fi

# Supervise one replica: run it, and when it exits on its own (a crash, an OOM kill of the main process),
# start it again with the same name and devices after a backoff that doubles while it keeps dying young.
# A crash loop is reported on stderr each time, never hidden. A replica that exits with EXIT_CONFIG could not load
# what it is configured to serve (replicadp_tasks/replica/outcomes.py, Exit.CONFIG): it is not restarted.
EXIT_CONFIG=78
supervise() {
  local name=$1; shift
  local child="" stopping="" backoff=1 crashes=0 started rc
  trap 'stopping=1; [[ -n $child ]] && kill -TERM "$child" 2>/dev/null' TERM INT
  while [[ -z $stopping ]]; do
    started=$SECONDS
    "$@" &
    child=$!
    # `wait` returns early when a trapped signal arrives: keep waiting until the replica has exited.
    while kill -0 "$child" 2>/dev/null; do wait "$child" || true; done
    rc=0
    wait "$child" || rc=$?
    [[ -n $stopping ]] && break
    if (( rc == EXIT_CONFIG )); then  # it cannot load what it is configured to serve: a restart would not mend it
      say ERROR "$name exited with status $rc: it cannot load its model or store (its log says why); not restarting"
      return "$rc"
    fi
    if (( SECONDS - started < 60 )); then
      crashes=$(( crashes + 1 ))
    else
      crashes=1 backoff=1
    fi
    (( crashes > 1 )) && say WARNING "$name is crash-looping ($crashes exits within a minute of start)"
    say WARNING "$name exited with status $rc after $(( SECONDS - started )) s; restarting in $backoff s"
    sleep "$backoff" & wait $! || true
    backoff=$(( backoff < 32 ? backoff * 2 : 60 ))
  done
}

pids=()
stop() {
  trap - INT TERM
  say INFO "stopping ${#pids[@]} replica(s)"
  kill -TERM "${pids[@]}" 2>/dev/null || true
  wait "${pids[@]}" 2>/dev/null || true
  exit 0
}
trap stop INT TERM

for (( i = 0; i < NUM_REPLICAS; i++ )); do
  n=$(( FIRST_REPLICA + i ))
  if [[ $DEVICES == cpu ]]; then
    # An empty CUDA_VISIBLE_DEVICES hides every GPU: the replica runs on the CPU.
    supervise "replica$n" env CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS="$THREADS_PER_REPLICA" \
      REPLICADP_THREADS="$THREADS_PER_REPLICA" "$CELERY" -A replicadp_tasks worker -n "replica$n@%h" "$@" &
  else
    mine=$(IFS=,; echo "${ids[*]:$(( i * GPUS_PER_REPLICA )):$GPUS_PER_REPLICA}")
    supervise "replica$n" env CUDA_VISIBLE_DEVICES="$mine" "$CELERY" -A replicadp_tasks worker -n "replica$n@%h" "$@" &
  fi
  pids+=($!)
done
say INFO "started ${#pids[@]} supervised replica(s) on DEVICES=$DEVICES"

# The launcher ends when every supervisor has (on Ctrl-C or SIGTERM, or when no replica can start): with the status
# of the last supervisor that failed.
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit "$status"
