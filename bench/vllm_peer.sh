#!/usr/bin/env bash
# vLLM 0.26 on the same workloads as `bench/gpu_check.sh --engine-bench`, on the same GPU machine,
# for the side-by-side figures (bench/compare_vllm.py puts both engines in one table and plot).
#
#   bash bench/vllm_peer.sh OUT_DIR MODEL_DIR [SETS]
#
# vLLM must already be unpacked in /tmp/site (shared/tools/vllm-peer/README.md: the bundle goes
# over in two chunks, one command each). SETS, comma-separated, from startup, t128, latency,
# t1000, t2048 (default all, in that order: the first vLLM start of a machine is the cold one,
# the later ones find torch.compile's cache warm).
set -uo pipefail
OUT_DIR=${1:?usage: bash bench/vllm_peer.sh OUT_DIR MODEL_DIR [SETS]}
MODEL=${2:?usage: bash bench/vllm_peer.sh OUT_DIR MODEL_DIR [SETS]}
SETS=${3:-startup,t128,latency,t1000,t2048}
mkdir -p "$OUT_DIR"
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
status=0
want() { [[ ",$SETS," == *",$1,"* ]]; }
VLLM=(python3 -m vllm.entrypoints.cli.main)
# VLLM_EXTRA: more engine arguments for every set, e.g. "--quantization fp8 --kv-cache-dtype fp8".
# shellcheck disable=SC2206
EXTRA=(${VLLM_EXTRA:-})
T=${VLLM_BENCH_TIMEOUT:-400}
NUM_PROMPTS=${VLLM_NUM_PROMPTS:-1000}  # prompts per throughput set

if want startup; then
  # Cold start to ready: a fresh process imports vLLM and builds LLM(...) with dummy weights.
  start=$(date +%s.%N)
  timeout "$T" python3 - "$MODEL" "$start" > "$OUT_DIR/vllm_startup.log" 2>&1 <<'EOF' || status=1
import json, sys, time
model, spawn = sys.argv[1], float(sys.argv[2])
t0 = time.time()
from vllm import LLM
t_import = time.time()
llm = LLM(model, load_format="dummy", dtype="bfloat16", max_model_len=2048)
t_ready = time.time()
print("VLLM_STARTUP " + json.dumps({"total_s": t_ready - spawn, "import_vllm_s": t_import - t0,
                                    "llm_init_s": t_ready - t_import}), flush=True)
EOF
  grep VLLM_STARTUP "$OUT_DIR/vllm_startup.log" | sed 's/^VLLM_STARTUP //' > "$OUT_DIR/vllm_startup.json"
  cat "$OUT_DIR/vllm_startup.json"
fi

# throughput NAME IN OUT MAX_MODEL_LEN: vLLM's own bench (random prompts, ignore_eos,
# temperature 1.0), VLLM_NUM_PROMPTS prompts (default 1000).
throughput() {
  local name=$1 in=$2 out=$3 mml=$4
  timeout "$T" "${VLLM[@]}" bench throughput --model "$MODEL" --load-format dummy --dtype bfloat16 \
    "${EXTRA[@]}" --dataset-name random --random-input-len "$in" --random-output-len "$out" \
    --num-prompts "$NUM_PROMPTS" --max-model-len "$mml" --output-json "$OUT_DIR/$name.json" \
    > "$OUT_DIR/$name.log" 2>&1 || status=1
  grep -E "^Throughput|Total num" "$OUT_DIR/$name.log"
}
want t128 && throughput vllm_throughput_128_128 128 128 2048
if want latency; then
  timeout "$T" "${VLLM[@]}" bench latency --model "$MODEL" --load-format dummy --dtype bfloat16 \
    "${EXTRA[@]}" --input-len 128 --output-len 256 --batch-size 1 --max-model-len 2048 \
    --num-iters-warmup 3 --num-iters 10 --output-json "$OUT_DIR/vllm_latency.json" \
    > "$OUT_DIR/vllm_latency.log" 2>&1 || status=1
  grep -E "Avg latency|percentile" "$OUT_DIR/vllm_latency.log" | head -3
fi
want t1000 && throughput vllm_throughput_1000_1000 1000 1000 2048
want t2048 && throughput vllm_throughput_2048_128 2048 128 4096
exit $status
