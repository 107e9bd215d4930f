#!/usr/bin/env bash
# Tensor parallelism on a 2-GPU host (issue 23), in one script for the lead:
#   1. build pyorch with CUDA and the all-reduce benchmark binary;
#   2. tests: the custom all-reduce on 2 GPUs (exact sums, graph replays, NCCL fallback), the
#      CPU/gloo TP tests, and TP=2 == TP=1 greedy on 2 GPUs (custom all-reduce and NCCL);
#   3. bench_custom_all_reduce: the kernel (one-shot, two-shot, auto) against NCCL, bf16,
#      4 KiB to 256 MiB, plotted with the targets checked (plot_all_reduce.py);
#   4. Llama-3-8B shape (dummy bf16 weights) batch-1 decode, TP=2 and TP=1 in the same run
#      (target: TP=2 <= 3.6 ms/token on 2 H100s).
#
#   bash bench/probes/tp_gpu.sh OUT_DIR [MODEL]     (MODEL: an HF config folder of Llama-3-8B's
#                                                    shape; default .models/llama3-8b-dummy)
# Steps run in order; SKIP_BUILD=1, SKIP_TESTS=1, SKIP_BENCH=1, SKIP_DECODE=1 leave one out.
# Each writes OUT_DIR/<step>.log; the script's exit status is non-zero if any step failed.
set -uo pipefail
OUT_DIR=${1:?usage: bash bench/probes/tp_gpu.sh OUT_DIR [MODEL]}
MODEL=${2:-.models/llama3-8b-dummy}
cd "$(dirname "$0")/../.."
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-$(nproc)}
status=0
nvidia-smi topo -m > "$OUT_DIR/topo.txt" 2>&1
n_gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
echo "GPUs: $n_gpus"; [ "$n_gpus" -ge 2 ] || { echo "needs 2 GPUs"; exit 1; }

if [ "${SKIP_BUILD:-0}" != 1 ]; then
  echo "== build"
  python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT_DIR/build.log" 2>&1 &&
    python3 -c "import pyorch._C as c; assert c.with_cuda and hasattr(c, 'ipc_open')" &&
    cmake -S . -B build/cuda -G Ninja -DCMAKE_BUILD_TYPE=Release >> "$OUT_DIR/build.log" 2>&1 &&
    cmake --build build/cuda -j "$MAX_JOBS" --target bench_custom_all_reduce >> "$OUT_DIR/build.log" 2>&1 ||
    { echo "BUILD FAILED"; tail -40 "$OUT_DIR/build.log"; exit 1; }
  grep "bench_custom_all_reduce" "$OUT_DIR/build.log" | grep -i nccl
fi

if [ "${SKIP_TESTS:-0}" != 1 ]; then
  echo "== tests"
  timeout 900 python3 -m pytest -q -p no:cacheprovider -rs tests/cuda/allreduce \
    tests/pyorch/distributed tests/pyorch/executor/test_multiproc_executor.py \
    tests/pyorch/executor/test_ray_executor.py > "$OUT_DIR/tests.log" 2>&1 || status=1
  tail -3 "$OUT_DIR/tests.log"; grep -E "^(FAILED|ERROR)" "$OUT_DIR/tests.log" | head -20
fi

if [ "${SKIP_BENCH:-0}" != 1 ]; then
  echo "== bench_custom_all_reduce (2 GPUs, bf16, 4 KiB .. 256 MiB) vs NCCL"
  timeout 600 build/cuda/bench_custom_all_reduce --ranks 2 --dtype bf16 --min-bytes 4096 \
    --max-bytes 268435456 --json "$OUT_DIR/all_reduce.json" > "$OUT_DIR/all_reduce.txt" 2>&1 ||
    status=1
  cat "$OUT_DIR/all_reduce.txt"
  python3 bench/probes/plot_all_reduce.py "$OUT_DIR/all_reduce.json" --out "$OUT_DIR/all_reduce" ||
    status=1
fi

if [ "${SKIP_DECODE:-0}" != 1 ]; then
  for tp in 2 1; do
    echo "== Llama-3-8B shape batch-1 decode, TP=$tp ($MODEL, dummy bf16)"
    timeout 600 python3 -m pyorch.cli.main bench latency --model "$MODEL" --load-format dummy \
      --dtype bfloat16 --tensor-parallel-size "$tp" --input-len 128 --output-len 256 \
      --batch-size 1 --max-model-len 2048 --output-json "$OUT_DIR/latency_tp$tp.json" \
      > "$OUT_DIR/latency_tp$tp.log" 2>&1 || status=1
    grep -E "decode|custom all-reduce" "$OUT_DIR/latency_tp$tp.log" | tail -4
  done
fi
exit $status
