#!/usr/bin/env bash
# The GPU check of issue 11, on a machine with one GPU and nothing pre-made, in about
# 4 minutes: imports, random-weight checkpoints of real shapes, the CUDA-marked tests,
# the vLLM connector's transports on vLLM's GPU KV layout (issue 41: tcp staged with
# events, nixl VRAM where NIXL is installed, cuda_ipc between two processes; GB/s
# against a device-to-device copy), 1P1D on one GPU (two processes) against colocated,
# decode-step time with and without CUDA graphs at batch 1, 32 and 256, and `kvrelay
# bench offline` at batch 1, 32 and 256. Results (at most 8 files) go to $OUT (default
# ./device-out).
#
#   scripts/device-check.sh                 on the GPU (python3 there holds torch)
#   scripts/device-check.sh --device cpu    dry run: tiny shapes, no pytest, no reference
#
# Wheels the image lacks (msgspec, fastapi, ...) travel in .whl/ (scripts/
# device-wheels.sh fetches them here); they are installed into /tmp/site. NIXL
# (nixl-cu13, 56 MiB) travels in .whl-nixl/ on a call of its own (device-wheels.sh).
#   STEPS=connector-kv scripts/device-check.sh   that step alone (torch and numpy only)
set -u
DEVICE=cuda
[ "${1:-}" = "--device" ] && DEVICE=${2:?--device needs a value}
REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$REPO/device-out}
PY=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-230}
mkdir -p "$OUT"
cd "$REPO" || exit 2
START=$(date +%s)
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"
FAILED=0
exec 3>&1  # step lines reach the terminal whatever a step redirects

elapsed() { echo $(($(date +%s) - START)); }
step() {  # step NAME LIMIT_S CMD...: run with a time limit, record rc and seconds
  local name=$1 limit=$2 t0 rc
  shift 2
  t0=$(date +%s)
  timeout "$limit" "$@"
  rc=$?
  echo "$name rc=$rc seconds=$(($(date +%s) - t0))" | tee -a "$SUMMARY" >&3
  [ "$rc" = 0 ] || FAILED=1
  return "$rc"
}

for dir in .whl .whl-nixl; do
  if [ "$DEVICE" != cpu ] && compgen -G "$dir/*.whl" >/dev/null; then  # cp312 wheels
    step "wheels$dir" 60 "$PY" -m pip install -q --no-index --no-deps --no-compile \
      --no-cache-dir --upgrade --target /tmp/site "$dir"/*.whl
  fi
done
export PYTHONPATH="$REPO:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

if [ "${STEPS:-}" != connector-kv ]; then  # a NIXL-only call lacks the other wheels
  step imports 60 "$PY" scripts/device_check.py imports >"$OUT/imports.json"
  cat "$OUT/imports.json"
fi

# The vLLM connector's transports on vLLM's GPU layout (kvrelay/bench/connector_kv.py).
step connector-kv 120 "$PY" -m kvrelay.bench.connector_kv --device "$DEVICE" \
  >"$OUT/connector_kv.txt" 2>&1
cat "$OUT/connector_kv.txt"
if [ "${STEPS:-}" = connector-kv ]; then
  echo "total seconds=$(elapsed) failed=$FAILED" | tee -a "$SUMMARY"
  exit "$FAILED"
fi

MODELS=${MODELS:-/tmp/kvrelay-models}
SMALL=()
[ "$DEVICE" = cpu ] && SMALL=(--small)
step models 90 "$PY" scripts/device_check.py models "$MODELS" "${SMALL[@]}" \
  --device "$DEVICE" >"$OUT/models.log" 2>&1

if [ "$DEVICE" != cpu ]; then
  step cuda-tests 90 "$PY" -m pytest -q -s -p no:cacheprovider -o addopts= \
    tests/unit/relay/test_relay_cuda_ipc.py tests/unit/relay/test_relay_staging.py \
    tests/unit/relay/test_relay_device_cache.py \
    tests/unit/model/test_model_graphs.py tests/unit/core/test_step_completion.py >"$OUT/tests.log" 2>&1
  tail -5 "$OUT/tests.log"
fi

MAXTOK=32
[ "$DEVICE" = cpu ] && MAXTOK=8
step pd 120 "$PY" scripts/device_check.py pd "$MODELS/smollm2-pd" --device "$DEVICE" \
  --max-tokens "$MAXTOK" --out "$OUT/pd.json"

# Decode-step time with and without CUDA graphs (kvrelay/bench/graphs.py).
GRAPHS=$OUT/graphs.txt
: >"$GRAPHS"
if [ "$DEVICE" = cpu ]; then
  GARGS=(--dtype float32 --batch 1 2 --context 8 --steps 4)
else
  GARGS=(--dtype bfloat16 --batch 1 32 256 --context 128 --steps 16)
fi
for model in smollm2-135m llama-1b; do
  step "graphs-$model" 90 "$PY" -m kvrelay.bench.graphs "$MODELS/$model" \
    --device "$DEVICE" "${GARGS[@]}" >>"$GRAPHS" 2>&1
done
cat "$GRAPHS"

# Offline throughput (graphs on, the default on CUDA), most wanted first; a row that would start past the budget is skipped.
BENCH=$OUT/bench.txt
: >"$BENCH"
ROWS=("smollm2-135m 1" "llama-1b 256" "smollm2-135m 32" "smollm2-135m 256" "llama-1b 32")
for row in "${ROWS[@]}"; do
  set -- $row
  if [ "$(elapsed)" -gt "$BUDGET_S" ]; then
    echo "bench $1 batch $2 skipped: $(elapsed) s spent" | tee -a "$SUMMARY"
    continue
  fi
  echo "== $1 batch $2" >>"$BENCH"
  if [ "$DEVICE" = cpu ]; then
    ARGS=(--num-prompts 2 --prompt-len 8 --output-len 4 --skip-transformers --threads 1)
  else
    ARGS=(--num-prompts "$2" --prompt-len 128 --output-len 128 --threads 16)
  fi
  step "bench-$1-b$2" 90 "$PY" -m kvrelay bench offline --model "$MODELS/$1" \
    --device "$DEVICE" "${ARGS[@]}" >>"$BENCH" 2>&1
  tail -3 "$BENCH"
done

echo "total seconds=$(elapsed) failed=$FAILED" | tee -a "$SUMMARY"
exit "$FAILED"
