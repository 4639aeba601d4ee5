#!/usr/bin/env bash
# The GPU machine's side of bench/gpu_suite.py, run from the repository root there:
#     bash bench/gpu_run.sh CALL [gpu_suite options]
# CALL 1 carries .gpu/call1 (the target's first part, the wheels), CALL 2 carries .gpu/call2 (the
# target's second part, MT-bench, the conversations); bench/gpu_pack.py writes both and
# docs/gpu_runbook.md gives the device calls. What a call brings is kept under /tmp/draftsmith-gpu
# while the machine stays warm: once both parts are there the target is joined (its SHA-256
# checked) and the stages that need it run; stages already done are skipped.
set -uo pipefail
CALL=${1:?usage: bash bench/gpu_run.sh CALL [gpu_suite options]}
shift
STATE=/tmp/draftsmith-gpu
LOAD=.gpu/call$CALL
OUT=${OUT:-$STATE/out}
if [ ! -d "$LOAD" ]; then
    echo "error: $LOAD is missing: name it in the call's carry (docs/gpu_runbook.md)" >&2
    exit 2
fi
mkdir -p "$STATE/parts" "$STATE/site"
export DRAFTSMITH_CACHE=$STATE/cache PYTHONPATH=$STATE/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
if [ -d "$LOAD/wheels" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$STATE/site" "$LOAD"/wheels/*.whl
    # Suffix decoding's C++ extension (nanobind, no torch): built here, or its rows are left out.
    if ! python3 -m pip install -q --no-index --no-deps --no-build-isolation --target "$STATE/site" \
        "$LOAD"/wheels/arctic_inference-*.tar.gz >"$STATE/arctic-build.log" 2>&1; then
        echo "arctic-inference did not build (suffix rows left out); the end of its log:"
        tail -3 "$STATE/arctic-build.log"
    fi
fi
python3 -m pip install -q --no-deps --no-build-isolation --config-settings editable_mode=strict -e . || exit 1
cp -r "$LOAD/parts/." "$STATE/parts/"
DATA=()
if [ -f "$LOAD/data/conversations.jsonl.xz" ]; then
    cp "$LOAD/data/conversations.jsonl.xz" "$STATE/"
fi
if [ -f "$STATE/conversations.jsonl.xz" ]; then
    DATA=(--data "$STATE/conversations.jsonl.xz")
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python3 bench/gpu_suite.py --out "$OUT" --work "$STATE/work" --parts "$STATE/parts" "${DATA[@]}" "$@"
