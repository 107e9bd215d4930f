#!/usr/bin/env bash
# pyorch against vLLM 0.26 with tensor parallelism, same machine, same model folder, one run:
# 128/128 and 1000/1000 x 1000 throughput, batch-1 latency (128 in / 256 out) and cold start to
# ready, then bench/compare_vllm.py's table of ratios (pyorch speed / vLLM speed).
#
#   bash bench/tp_vs_vllm.sh OUT_DIR MODEL_DIR [TP] [SETS]
#
# TP defaults to 2; SETS, comma-separated, from startup, t128, latency, t1000, ray (default
# startup,t128,latency,t1000; ray adds pyorch's start-up with --distributed-executor-backend ray,
# which needs the ray package). Dummy bf16 weights (--load-format dummy), e.g.
#   Llama-3-8B on 2 H100s:   bash bench/tp_vs_vllm.sh out .models/llama3-8b-dummy 2
#   Llama-3-70B on 2 H200s:  bash bench/tp_vs_vllm.sh out .models/llama3-70b-dummy 2
# vLLM comes from /tmp/site (bench/vllm_peer.sh); pyorch from the current PYTHONPATH.
# PYORCH_EXTRA / VLLM_EXTRA add engine arguments to one side. Writes OUT_DIR/pyorch/*.json,
# OUT_DIR/vllm/*.json and OUT_DIR/compare.{json,png}; exits non-zero if a step failed.
set -uo pipefail
OUT_DIR=${1:?usage: bash bench/tp_vs_vllm.sh OUT_DIR MODEL_DIR [TP] [SETS]}
MODEL=${2:?usage: bash bench/tp_vs_vllm.sh OUT_DIR MODEL_DIR [TP] [SETS]}
TP=${3:-2}
SETS=${4:-startup,t128,latency,t1000}
cd "$(dirname "$0")/.."
P="$OUT_DIR/pyorch" V="$OUT_DIR/vllm"
mkdir -p "$P" "$V"
export PYTHONUNBUFFERED=1
status=0
want() { [[ ",$SETS," == *",$1,"* ]]; }
T=${TP_BENCH_TIMEOUT:-600}
# shellcheck disable=SC2206
common=(--model "$MODEL" --load-format dummy --dtype bfloat16 --tensor-parallel-size "$TP"
        ${PYORCH_EXTRA:-})

echo "== pyorch TP=$TP on $MODEL: $SETS"
if want startup; then
  timeout "$T" python3 -m pyorch.cli.main bench startup "${common[@]}" --max-model-len 2048 \
    --num-iters 1 --num-iters-warmup 0 --output-json "$P/startup.json" > "$P/startup.log" 2>&1 ||
    status=1
  tail -4 "$P/startup.log"
fi
if want ray; then
  timeout "$T" python3 -m pyorch.cli.main bench startup "${common[@]}" --max-model-len 2048 \
    --distributed-executor-backend ray --num-iters 1 --num-iters-warmup 0 \
    --output-json "$P/startup_ray.json" > "$P/startup_ray.log" 2>&1 || status=1
  tail -4 "$P/startup_ray.log"
fi
if want latency; then
  timeout "$T" python3 -m pyorch.cli.main bench latency "${common[@]}" --input-len 128 \
    --output-len 256 --batch-size 1 --max-model-len 2048 --output-json "$P/latency.json" \
    > "$P/latency.log" 2>&1 || status=1
  grep -v tokenizer "$P/latency.log" | tail -4
fi
# throughput NAME IN OUT TEMP: 1000 prompts; temperature 1.0 is vLLM's bench sampling.
throughput() {
  timeout "$T" python3 -m pyorch.cli.main bench throughput "${common[@]}" --input-len "$2" \
    --output-len "$3" --num-prompts 1000 --max-model-len 2048 --temperature "$4" --skip-hf \
    --output-json "$P/$1.json" > "$P/$1.log" 2>&1 || status=1
  grep -E "x output|output tok" "$P/$1.log" | tail -2
}
want t128 && throughput throughput_128_128_t1 128 128 1
want t1000 && throughput throughput_1000_1000_t1 1000 1000 1

echo "== vLLM TP=$TP"
vsets=$(echo "$SETS" | tr ',' '\n' | grep -E '^(startup|t128|latency|t1000)$' | paste -sd,)
VLLM_TP=$TP VLLM_EXTRA="--tensor-parallel-size $TP ${VLLM_EXTRA:-}" \
  bash bench/vllm_peer.sh "$V" "$MODEL" "$vsets" || status=1

python3 bench/compare_vllm.py --pyorch "$P" --vllm "$V" --out "$OUT_DIR/compare" \
  --title "$(basename "$MODEL"), TP=$TP, dummy bf16 weights" || status=1
exit $status
