#!/usr/bin/env bash
# pyorch against vLLM 0.26 with the same parallel layout on one multi-GPU host (issues 23, 25):
# tensor parallelism of any size, with or without expert parallelism, any model folder.
#
#   bash bench/multi_gpu_vs_vllm.sh OUT_DIR MODEL_DIR TP [ep|noep]
#
# Both engines get --tensor-parallel-size TP (and --enable-expert-parallel with "ep"), dummy bf16
# weights (--load-format dummy) and, when QUANT is set, the same --quantization QUANT. Workloads
# (SETS, comma-separated): t128 (128 in / 128 out), t1000 (1000 / 1000), both NUM_PROMPTS prompts
# (default 1000) at temperature 1.0 (vLLM's bench sampling), latency (batch 1, 128 in / 256
# out) and startup (cold start to a ready LLM: `pyorch bench startup`, vLLM's LLM(...) timed by
# bench/vllm_peer.sh; only --tensor-parallel-size is passed to vLLM's there, so not with
# ep/QUANT). Each engine runs its own benchmark (`pyorch bench ...`, `vllm bench ...`, through
# bench/vllm_peer.sh); bench/compare_vllm.py then prints both and pyorch/vLLM per workload and
# writes OUT_DIR/compare.json + .png. Environment:
#   ENGINES=pyorch,vllm   which engines to run (a 10-minute device command may fit only one:
#                         run them in two calls, then ENGINES=none to compare)
#   SETS=t128,t1000,latency (and startup)   QUANT=   NUM_PROMPTS=1000   MAX_MODEL_LEN=2048
#   T=900 (timeout per run, s)   PYORCH_EXTRA / VLLM_EXTRA (more engine flags for one side)
# vLLM must be unpacked in /tmp/site (shared/tools/vllm-peer/README.md); only vLLM's processes see
# it. pyorch must be built with CUDA in this checkout. MODEL_DIR needs config.json and tokenizer
# files; a folder without a tokenizer (bench/models/qwen3-235b-a22b-dummy) gets one copied from
# a sibling folder (TOKENIZER_FROM) of the same vocabulary size.
set -uo pipefail
usage="usage: bash bench/multi_gpu_vs_vllm.sh OUT_DIR MODEL_DIR TP [ep|noep]"
OUT_DIR=${1:?$usage}
MODEL=${2:?$usage}
TP=${3:?$usage}
EP=${4:-noep}
case "$EP" in ep|noep) ;; *) echo "$usage"; exit 2 ;; esac
ENGINES=${ENGINES:-pyorch,vllm}
SETS=${SETS:-t128,t1000,latency}
N=${NUM_PROMPTS:-1000}
MML=${MAX_MODEL_LEN:-2048}
T=${T:-900}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
HERE=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONUNBUFFERED=1
status=0
want() { [[ ",$SETS," == *",$1,"* ]]; }
engine() { [[ ",$ENGINES," == *",$1,"* ]]; }

if [ ! -f "$MODEL/tokenizer.json" ]; then
  src=${TOKENIZER_FROM:-}
  if [ -z "$src" ]; then  # a sibling dummy folder with the same vocabulary size
    vocab=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['vocab_size'])" \
      "$MODEL/config.json")
    for d in "$MODEL"/../*/ "$HERE"/.models/*/; do
      if [ -f "$d/tokenizer.json" ] && [ -f "$d/config.json" ] && [ "$(python3 -c \
          "import json,sys; print(json.load(open(sys.argv[1]))['vocab_size'])" "$d/config.json")" = "$vocab" ]; then
        src=$d; break
      fi
    done
  fi
  [ -n "$src" ] || { echo "$MODEL has no tokenizer and no folder of the same vocabulary was found:"\
    "make one with make_dummy_tokenizer.py (bench/models/qwen3-235b-a22b-dummy/README.md)"; exit 1; }
  echo "tokenizer for $MODEL copied from $src"
  cp "$src"/tokenizer.json "$src"/tokenizer_config.json "$MODEL"/ || exit 1
fi

layout=(--tensor-parallel-size "$TP")
[ "$EP" = ep ] && layout+=(--enable-expert-parallel)
[ -n "${QUANT:-}" ] && layout+=(--quantization "$QUANT")
{
  echo "model $MODEL  layout ${layout[*]}  prompts $N  sets $SETS"
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
} | tee "$OUT_DIR/layout.txt"

if engine pyorch; then
  # shellcheck disable=SC2206
  common=(--model "$MODEL" --load-format dummy --dtype bfloat16 "${layout[@]}" ${PYORCH_EXTRA:-})
  py_throughput() {  # NAME IN OUT: temperature 1.0 like vLLM's bench, no transformers baseline
    (cd "$HERE" && timeout "$T" python3 -m pyorch.cli.main bench throughput "${common[@]}" \
      --input-len "$2" --output-len "$3" --num-prompts "$N" --temperature 1 --hf-best --skip-hf \
      --max-model-len "$MML" --output-json "$OUT_DIR/$1.json") > "$OUT_DIR/$1.log" 2>&1 || status=1
    grep -E "x output|output tok" "$OUT_DIR/$1.log" | tail -3
  }
  if want startup; then
    (cd "$HERE" && timeout "$T" python3 -m pyorch.cli.main bench startup "${common[@]}" \
      --max-model-len "$MML" --num-iters 1 --num-iters-warmup 0 \
      --output-json "$OUT_DIR/startup.json") > "$OUT_DIR/startup.log" 2>&1 || status=1
    grep -v tokenizer "$OUT_DIR/startup.log" | tail -3
  fi
  want t128 && py_throughput throughput_128_128_t1 128 128
  want t1000 && py_throughput throughput_1000_1000_t1 1000 1000
  if want latency; then
    (cd "$HERE" && timeout "$T" python3 -m pyorch.cli.main bench latency "${common[@]}" \
      --input-len 128 --output-len 256 --batch-size 1 --max-model-len "$MML" \
      --output-json "$OUT_DIR/latency.json") > "$OUT_DIR/latency.log" 2>&1 || status=1
    grep -v tokenizer "$OUT_DIR/latency.log" | tail -4
  fi
fi

if engine vllm; then
  vsets=""
  if want startup; then
    if [ "$EP" = ep ] || [ -n "${QUANT:-}" ]; then
      echo "startup: vLLM's start-up set takes only --tensor-parallel-size; left out with ep/QUANT"
    else
      vsets+="startup,"
    fi
  fi
  want t128 && vsets+="t128,"
  want latency && vsets+="latency,"
  want t1000 && vsets+="t1000,"
  VLLM_EXTRA="${layout[*]} ${VLLM_EXTRA:-}" VLLM_TP=$TP VLLM_NUM_PROMPTS=$N VLLM_BENCH_TIMEOUT=$T \
    bash "$HERE/bench/vllm_peer.sh" "$OUT_DIR" "$MODEL" "${vsets%,}" || status=1
fi

if ls "$OUT_DIR"/vllm_*.json > /dev/null 2>&1; then
  (cd "$HERE" && python3 bench/compare_vllm.py --pyorch "$OUT_DIR" --vllm "$OUT_DIR" \
    --out "$OUT_DIR/compare" --title "$(basename "$MODEL"), ${layout[*]}, dummy weights" \
    --note "$(cat "$OUT_DIR/layout.txt")") || status=1
fi
exit $status
