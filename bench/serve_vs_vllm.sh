#!/usr/bin/env bash
# pyorch-serve against `vllm serve` under traffic (issue 24), on one GPU machine, both driven by
# vLLM's own client (`vllm bench serve`), one engine after the other:
#
#   bash bench/serve_vs_vllm.sh OUT_DIR MODEL_DIR
#
# MODEL_DIR: a config + tokenizer folder (dummy weights), e.g. a copy of
# shared/tools/vllm-peer/llama3-8b-dummy. pyorch must be built with CUDA in this checkout
# (bench/gpu_check.sh builds it).
# vLLM must already be unpacked in /tmp/site (shared/tools/vllm-peer/README.md); only vLLM's
# processes see it on PYTHONPATH. Environment knobs:
#   ENGINES=pyorch,vllm   which servers to run (a device command has 10 minutes: run one engine
#                         per command, then ENGINES=none to draw the plots from both engines' files)
#   SETS=r4,r16,rinf,prefix,ratio,offline   the workloads:
#     r4 / r16 / rinf  random 512 in / 256 out, ignore_eos, at request rate 4, 16, inf: 500 prompts
#                      (NUM_PROMPTS), but NUM_PROMPTS_RATE4 (200) at rate 4, where 500 would take
#                      over 2 minutes per engine
#     prefix           prefix repetition: 8 prefixes of 2048 tokens, 256-token suffixes, 256 out,
#                      500 prompts at rate inf
#     ratio            random 512/256 with --random-range-ratio 0.9 (input and output), 500 prompts
#                      at rate inf (ratio16: the same at rate 16)
#     offline          the prefix and ratio workloads through `pyorch bench throughput` and
#                      `vllm bench throughput` (no server)
#   PORT (8100), MAX_MODEL_LEN (4096), NUM_PROMPTS (500), NUM_PROMPTS_RATE4 (200),
#   T (timeout per client run, 900 s),
#   PYORCH_SERVE_ARGS / VLLM_SERVE_ARGS (extra server flags, e.g. --target-step-ms 30).
# Writes OUT_DIR/<engine>_<workload>.json (vLLM's result format, TTFT / TPOT / ITL / E2E at p50 and
# p99, goodput under ttft:500 tpot:50), <engine>_<workload>.counters.txt (the server's prompt,
# generation and prefix-cache token counters before and after), server and client logs, and for
# each workload both engines
# ran, OUT_DIR/compare_<workload>.png + .json (bench/plot_serve_compare.py: latency against
# output throughput, per-rate ratios pyorch / vLLM).
set -uo pipefail
OUT_DIR=${1:?usage: bash bench/serve_vs_vllm.sh OUT_DIR MODEL_DIR}
MODEL=${2:?usage: bash bench/serve_vs_vllm.sh OUT_DIR MODEL_DIR}
ENGINES=${ENGINES:-pyorch,vllm}
SETS=${SETS:-r4,r16,rinf,prefix,ratio,offline}
PORT=${PORT:-8100}
MML=${MAX_MODEL_LEN:-4096}
N=${NUM_PROMPTS:-500}
N4=${NUM_PROMPTS_RATE4:-200}
T=${T:-900}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
HERE=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONUNBUFFERED=1
VLLM_ENV=(env PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0)
VLLM=("${VLLM_ENV[@]}" python3 -m vllm.entrypoints.cli.main)
status=0
want() { [[ ",$SETS," == *",$1,"* ]]; }
has_engine() { [[ ",$ENGINES," == *",$1,"* ]]; }

wait_ready() {  # PID: polls /v1/models until it answers (or the server died)
  for _ in $(seq 1 600); do
    curl -sf "http://127.0.0.1:$PORT/v1/models" > /dev/null && return 0
    kill -0 "$1" 2> /dev/null || return 1
    sleep 1
  done
  return 1
}

stop_server() {  # PID
  kill -TERM "$1" 2> /dev/null
  for _ in $(seq 1 60); do kill -0 "$1" 2> /dev/null || return 0; sleep 1; done
  kill -KILL "$1" 2> /dev/null
}

# counters FILE LABEL: appends the server's token and prefix-cache counters (pyorch's and vLLM's
# Prometheus names) to FILE under LABEL. Before and after each client run: what the server
# prefilled and what the prefix cache gave, against the client's own input-token count.
counters() {
  { echo "# $2"
    curl -sf "http://127.0.0.1:$PORT/metrics" | grep -E \
      '^(pyorch|vllm):(prompt_tokens|generation_tokens|prefix_cache_queries|prefix_cache_hits)_total[{ ]'
  } >> "$1"
}

# client ENGINE NAME RATE SEED DATASET_FLAGS...: one vLLM bench serve run against the server up
# now (NUM=... in the environment overrides the number of prompts). Each workload has its own
# dataset seed: with one seed, every random workload replays the same prompts, so a later run
# finds them all in the prefix cache and its TTFT measures no prefill (both engines did that in
# the runs of 2026-11-26: rate inf served 256k prompt tokens in 0.9 s).
client() {
  local engine=$1 name=$2 rate=$3 seed=$4
  shift 4
  counters "$OUT_DIR/${engine}_${name}.counters.txt" before
  timeout "$T" "${VLLM[@]}" bench serve --backend openai --base-url "http://127.0.0.1:$PORT" \
    --endpoint /v1/completions --model "$MODEL" --tokenizer "$MODEL" --num-prompts "${NUM:-$N}" \
    --request-rate "$rate" --seed "$seed" --ignore-eos --percentile-metrics ttft,tpot,itl,e2el \
    --metric-percentiles 50,99 --goodput ttft:500 tpot:50 --save-result \
    --result-dir "$OUT_DIR" --result-filename "${engine}_${name}.json" "$@" \
    > "$OUT_DIR/${engine}_${name}.log" 2>&1 || status=1
  counters "$OUT_DIR/${engine}_${name}.counters.txt" after
  grep -E "Output token throughput|Median TTFT|P99 TTFT|P99 ITL|goodput" \
    "$OUT_DIR/${engine}_${name}.log" | sed "s/^/  $engine $name: /"
}

RANDOM_512=(--dataset-name random --random-input-len 512 --random-output-len 256)
PREFIX=(--dataset-name prefix_repetition --prefix-repetition-prefix-len 2048
        --prefix-repetition-suffix-len 256 --prefix-repetition-num-prefixes 8
        --prefix-repetition-output-len 256)
RATIO=("${RANDOM_512[@]}" --random-range-ratio 0.9)

serve_sets() {  # ENGINE
  local engine=$1
  want r4 && NUM=$N4 client "$engine" random_rate4 4 1 "${RANDOM_512[@]}"
  want r16 && client "$engine" random_rate16 16 2 "${RANDOM_512[@]}"
  want rinf && client "$engine" random_rateinf inf 3 "${RANDOM_512[@]}"
  want prefix && client "$engine" prefix_rateinf inf 4 "${PREFIX[@]}"
  want ratio16 && client "$engine" ratio_rate16 16 6 "${RATIO[@]}"
  want ratio && client "$engine" ratio_rateinf inf 5 "${RATIO[@]}"
}

needs_server() { want r4 || want r16 || want rinf || want prefix || want ratio || want ratio16; }

if has_engine pyorch && needs_server; then
  echo "== pyorch-serve"
  (cd "$HERE" && exec python3 -m pyorch.cli.main serve "$MODEL" --load-format dummy \
    --dtype bfloat16 --max-model-len "$MML" --port "$PORT" ${PYORCH_SERVE_ARGS:-}) \
    > "$OUT_DIR/pyorch_server.log" 2>&1 &
  pid=$!
  if wait_ready "$pid"; then serve_sets pyorch; else echo "pyorch-serve did not start"; status=1; fi
  stop_server "$pid"
fi

if has_engine vllm && needs_server; then
  echo "== vllm serve"
  "${VLLM[@]}" serve "$MODEL" --load-format dummy --dtype bfloat16 --max-model-len "$MML" \
    --port "$PORT" ${VLLM_SERVE_ARGS:-} > "$OUT_DIR/vllm_server.log" 2>&1 &
  pid=$!
  if wait_ready "$pid"; then serve_sets vllm; else echo "vllm serve did not start"; status=1; fi
  stop_server "$pid"
fi

if want offline; then  # the same two workloads offline, each engine's own throughput bench
  if has_engine pyorch; then
    (cd "$HERE" && timeout "$T" python3 -m pyorch.cli.main bench throughput --model "$MODEL" \
      --load-format dummy --dtype bfloat16 --max-model-len "$MML" --num-prompts "$N" --skip-hf --hf-best \
      --temperature 1.0 --dataset-name prefix_repetition --prefix-repetition-prefix-len 2048 \
      --prefix-repetition-suffix-len 256 --prefix-repetition-num-prefixes 8 \
      --prefix-repetition-output-len 256 --no-plot \
      --output-json "$OUT_DIR/pyorch_offline_prefix.json") \
      > "$OUT_DIR/pyorch_offline_prefix.log" 2>&1 || status=1
    (cd "$HERE" && timeout "$T" python3 -m pyorch.cli.main bench throughput --model "$MODEL" \
      --load-format dummy --dtype bfloat16 --max-model-len "$MML" --num-prompts "$N" --skip-hf --hf-best \
      --temperature 1.0 --input-len 512 --output-len 256 --random-range-ratio 0.9 --no-plot \
      --output-json "$OUT_DIR/pyorch_offline_ratio.json") \
      > "$OUT_DIR/pyorch_offline_ratio.log" 2>&1 || status=1
    grep -h "output tok/s" "$OUT_DIR"/pyorch_offline_*.log | sed 's/^/  pyorch offline: /'
  fi
  if has_engine vllm; then
    # vLLM's bench throughput takes the random lengths from --random-input-len /
    # --random-output-len (defaults 1024 / 128); its --input-len / --output-len do not reach them.
    timeout "$T" "${VLLM[@]}" bench throughput --model "$MODEL" --load-format dummy \
      --dtype bfloat16 --max-model-len "$MML" --num-prompts "$N" "${PREFIX[@]}" \
      --output-json "$OUT_DIR/vllm_offline_prefix.json" \
      > "$OUT_DIR/vllm_offline_prefix.log" 2>&1 || status=1
    timeout "$T" "${VLLM[@]}" bench throughput --model "$MODEL" --load-format dummy \
      --dtype bfloat16 --max-model-len "$MML" --num-prompts "$N" "${RATIO[@]}" \
      --output-json "$OUT_DIR/vllm_offline_ratio.json" \
      > "$OUT_DIR/vllm_offline_ratio.log" 2>&1 || status=1
    grep -h "^Throughput" "$OUT_DIR"/vllm_offline_*.log | sed 's/^/  vllm offline: /'
  fi
fi

# Plots: every workload both engines have files for (this run's or an earlier command's).
plot() {  # NAME FILE_SUFFIXES...
  local name=$1
  shift
  local p=() v=()
  for s in "$@"; do
    [[ -f "$OUT_DIR/pyorch_$s.json" ]] && p+=("$OUT_DIR/pyorch_$s.json")
    [[ -f "$OUT_DIR/vllm_$s.json" ]] && v+=("$OUT_DIR/vllm_$s.json")
  done
  ((${#p[@]} && ${#v[@]})) || return 0
  python3 "$HERE/bench/plot_serve_compare.py" --engine vllm "${v[@]}" --engine pyorch "${p[@]}" \
    --title "$name: $(basename "$MODEL"), $N prompts ($N4 at rate 4), vLLM's client" \
    --out "$OUT_DIR/compare_$name.png" || status=1
}
plot random_512_256 random_rate4 random_rate16 random_rateinf
plot prefix_repetition prefix_rateinf
plot range_ratio_0.9 ratio_rate16 ratio_rateinf
exit $status
