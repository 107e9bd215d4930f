#!/usr/bin/env bash
# Qwen3-30B-A3B end to end on one GPU, dummy bf16 weights (issue 22): pyorch's `bench latency`
# (batch 1, 128 in / 256 out: decode ms/token against the weight-read floor of the bytes a step
# must read, i.e. the top_k active experts + attention + norms + LM head at copy bandwidth) and
# `bench throughput` (1000 prompts, 128/128 and 1000/1000, temperature 1.0 as vLLM's bench
# samples, --hf-best --skip-hf); then, when vLLM's bundle is unpacked in /tmp/site, vLLM's own
# `bench latency` / `bench throughput` on the same folder (bench/vllm_peer.sh) and the
# side-by-side table (bench/compare_vllm.py: pyorch speed / vLLM speed per workload).
#
#   bash bench/moe_e2e.sh OUT_DIR [MODEL_DIR] [SETS]
#
# MODEL_DIR defaults to .models/qwen3-30b-a3b-dummy (config + tokenizer; about 61 GB of weights,
# so the KV cache gets what gpu_memory_utilization leaves: ~11 GB on an 80 GB H100 at 0.92).
# SETS, comma-separated, from latency, t128, t1000 (default all). PYORCH_EXTRA / VLLM_EXTRA:
# more engine arguments for either side. MOE_E2E_TIMEOUT bounds each step (default 300 s).
set -uo pipefail
OUT_DIR=${1:?usage: bash bench/moe_e2e.sh OUT_DIR [MODEL_DIR] [SETS]}
MODEL=${2:-.models/qwen3-30b-a3b-dummy}
SETS=${3:-latency,t128,t1000}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
T=${MOE_E2E_TIMEOUT:-300}
status=0
want() { [[ ",$SETS," == *",$1,"* ]]; }
# shellcheck disable=SC2206
common=(--model "$MODEL" --load-format dummy --dtype bfloat16 --max-model-len 2048 ${PYORCH_EXTRA:-})

echo "== pyorch on $MODEL: $SETS"
if want latency; then
  timeout "$T" python3 -m pyorch.cli.main bench latency "${common[@]}" --input-len 128 \
    --output-len 256 --batch-size 1 --output-json "$OUT_DIR/latency.json" \
    > "$OUT_DIR/latency.log" 2>&1 || status=1
  grep -v tokenizer "$OUT_DIR/latency.log" | tail -6
fi
# throughput NAME IN OUT: 1000 prompts at temperature 1.0 (vLLM's bench samples so too).
throughput() {
  timeout "$T" python3 -m pyorch.cli.main bench throughput "${common[@]}" --input-len "$2" \
    --output-len "$3" --num-prompts 1000 --temperature 1 --hf-best --skip-hf \
    --output-json "$OUT_DIR/$1.json" > "$OUT_DIR/$1.log" 2>&1 || status=1
  grep -E "batch|Captured|x output|output tok" "$OUT_DIR/$1.log" | tail -4
}
want t128 && throughput throughput_128_128_t1 128 128
want t1000 && throughput throughput_1000_1000_t1 1000 1000

if [ -d /tmp/site/vllm ]; then
  echo "== vLLM on $MODEL"
  vsets=()
  want latency && vsets+=(latency)
  want t128 && vsets+=(t128)
  want t1000 && vsets+=(t1000)
  VLLM_BENCH_TIMEOUT=$T VLLM_EXTRA="${VLLM_EXTRA:-}" \
    bash bench/vllm_peer.sh "$OUT_DIR/vllm" "$MODEL" "$(IFS=,; echo "${vsets[*]}")" || status=1
  python3 bench/compare_vllm.py --pyorch "$OUT_DIR" --vllm "$OUT_DIR/vllm" \
    --out "$OUT_DIR/moe_e2e_vs_vllm" --title "Qwen3-30B-A3B shapes, dummy bf16 weights" || status=1
else
  echo "== vLLM not in /tmp/site: pyorch only"
fi

# The batch-1 floor, from pyorch's latency run (pyorch/benchmarks/latency.py counts the active
# experts only for MoE layers).
if [ -f "$OUT_DIR/latency.json" ]; then
  python3 - "$OUT_DIR/latency.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))["summary"]
print(f"batch-1 decode {s['decode_ms_per_token']:.3f} ms/token; weight-read floor "
      f"{s['weight_read_bytes'] / 1e9:.3f} GB at {s['copy_bandwidth']['bytes_per_s'] / 1e9:.0f} "
      f"GB/s = {s['weight_read_floor_ms']:.3f} ms -> {s['decode_over_weight_read_floor']:.2f}x "
      "the floor (target <= 1.5x)")
PY
fi
exit $status
