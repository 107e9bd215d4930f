#!/usr/bin/env bash
# A/B timing of batch-1 decode under environment variants, one process each (the switches are
# read once per process), in an order that interleaves the variants over REPEATS rounds so that
# a drifting clock or a noisy neighbour hits all of them alike:
#
#   bash bench/latency_sweep.sh OUT_DIR MODEL_DIR NAME=ENV[,ENV...] ...   (REPEATS=2 by default)
#
# e.g. base= pdl_off=PYORCH_PDL=0. Each run is
# `pyorch bench latency` at the gpu_check.sh settings (batch 1, in 128, out 256, dummy bf16,
# max_model_len 2048; INPUT_LEN and OUTPUT_LEN change the lengths, LATENCY_ARGS adds engine
# flags to every run, e.g. "--quantization fp8 --kv-cache-dtype fp8"),
# logged as OUT_DIR/latency_NAME_rR.{log,json}; OUT_DIR/latency_sweep.txt sums them up.
set -uo pipefail
OUT_DIR=${1:?usage: bash bench/latency_sweep.sh OUT_DIR MODEL_DIR NAME=ENV[,ENV...] ...}
MODEL=${2:?usage: bash bench/latency_sweep.sh OUT_DIR MODEL_DIR NAME=ENV[,ENV...] ...}
shift 2
cd "$(dirname "$0")/.."
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
if [ -d /tmp/pyorch_whl ]; then export PYTHONPATH=/tmp/pyorch_whl${PYTHONPATH:+:$PYTHONPATH}; fi
summary="$OUT_DIR/latency_sweep.txt"
: > "$summary"
for round in $(seq 1 "${REPEATS:-2}"); do
  for spec in "$@"; do
    name=${spec%%=*}
    envs=${spec#*=}
    [ "$envs" = "$spec" ] && envs=""
    log="$OUT_DIR/latency_${name}_r${round}.log"
    # shellcheck disable=SC2086
    env ${envs//,/ } timeout "${LATENCY_TIMEOUT:-240}" python3 -m pyorch.cli.main bench latency \
      --model "$MODEL" --load-format dummy --dtype bfloat16 --input-len "${INPUT_LEN:-128}" \
      --output-len "${OUTPUT_LEN:-256}" --batch-size 1 --max-model-len 2048 \
      --num-iters "${NUM_ITERS:-10}" ${LATENCY_ARGS:-} \
      --output-json "$OUT_DIR/latency_${name}_r${round}.json" > "$log" 2>&1
    line=$(grep -m1 "ms per output token" "$log" || echo "FAILED (see $log)")
    echo "$name [${envs:-default}] round $round: $line" | tee -a "$summary"
  done
done
