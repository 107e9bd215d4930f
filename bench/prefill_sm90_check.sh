#!/usr/bin/env bash
# One device call for the sm90 prefill kernel (Hopper): build pyorch (pip install -e), run
# tests/cuda/attention, bench `bench_paged_attention --mode prefill` for the bf16 head sizes
# (128, 64, 256 by default), the torch SDPA flash baseline in the same run, and optionally an
# Nsight Compute profile of one 8k launch at head 128.
#
#   bash bench/prefill_sm90_check.sh OUT_DIR [--heads "128 64 256"] [--ncu] [--no-tests]
#
# Writes OUT_DIR/{tests.txt, prefill.txt, prefill.json, ncu.txt}; prints a short table last.
set -uo pipefail
OUT=${1:?usage: bash bench/prefill_sm90_check.sh OUT_DIR [options]}
shift
HEADS="128 64 256" NCU=0 TESTS=1
while [ $# -gt 0 ]; do
  case "$1" in
    --heads) HEADS="$2"; shift ;;
    --ncu) NCU=1 ;;
    --no-tests) TESTS=0 ;;
  esac
  shift
done
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-$(nproc)}
t0=$(date +%s)
stamp() { echo "[t=$(( $(date +%s) - t0 ))s] $*"; }

if ! python3 -m pip install --no-build-isolation --no-deps -e . > /tmp/prefill_build.log 2>&1; then
  echo "BUILD FAILED"; tail -40 /tmp/prefill_build.log | tee "$OUT/build_failed.txt"; exit 1
fi
grep -E "spill|error" /tmp/prefill_build.log | grep -i sm90 | head -5
stamp "built"
# The bench binary from the same build tree (reuses the library objects), beside the tests.
(cmake --build build/cmake --target bench_paged_attention -j 4 > /tmp/bench_build.log 2>&1;
 echo "rc=$?" >> /tmp/bench_build.log) &
bench_build=$!

if [ "$TESTS" = 1 ]; then
  timeout 260 python3 -m pytest tests/cuda/attention -q -p no:cacheprovider -rf \
    > "$OUT/tests.txt" 2>&1
  echo "pytest rc=$?" >> "$OUT/tests.txt"
  stamp "tests: $(tail -2 "$OUT/tests.txt" | head -1)"
fi
wait $bench_build
tail -1 /tmp/bench_build.log
BIN=build/cmake/bench_paged_attention
[ -x "$BIN" ] || { echo "no bench binary"; tail -20 /tmp/bench_build.log; exit 1; }

rm -f /tmp/prefill_d*.json
{
  echo "# $(date -u +%F) $(nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader)"
  for d in $HEADS; do
    echo "== head $d --batch 1,1,4 --context 4096,8192,2048"
    timeout 60 $BIN --mode prefill --head-size $d --batch 1,1,4 \
      --context 4096,8192,2048 --json "/tmp/prefill_d${d}.json" | grep -v "^device"
  done
  echo "== torch_sdpa_flash"
  for d in $HEADS; do
    timeout 90 python3 bench/sdpa_prefill.py --head-size $d --batch 1,1,4 --context 4096,8192,2048
  done
  for d in $HEADS; do  # again: the spread between two runs of one shape is the noise
    echo "== head $d (repeat)"
    timeout 60 $BIN --mode prefill --head-size $d --batch 1,1,4 \
      --context 4096,8192,2048 | grep -v "^device"
  done
} > "$OUT/prefill.txt" 2>&1
# shellcheck disable=SC2046
python3 - "$OUT/prefill.json" $(for d in $HEADS; do echo "/tmp/prefill_d$d.json"; done) <<'PY'
import json, sys
merged = {p: json.load(open(p)) for p in sys.argv[2:]}
json.dump(merged, open(sys.argv[1], "w"), indent=1)
PY
stamp "bench"

if [ "$NCU" = 1 ]; then
  timeout 120 ncu --kernel-name regex:paged_prefill_sm90 \
    --launch-count 1 --section SpeedOfLight --section ComputeWorkloadAnalysis \
    --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
    --section InstructionStats \
    --metrics sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,smsp__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum \
    $BIN --mode prefill --batch 1 --context 8192 > /tmp/ncu_prefill.txt 2>&1
  { echo "== ncu head 128"; grep -vE "^==PROF==|^device|^dtype" /tmp/ncu_prefill.txt |
      grep -E "[0-9]" | sed 's/  */ /g' | head -90; } >> "$OUT/ncu.txt"
fi
stamp "ncu"
grep -E "^(FAILED|ERROR)" "$OUT/tests.txt" | head -20
tail -3 "$OUT/tests.txt"
grep -E "^==|TFLOP" "$OUT/prefill.txt" | sed -E 's/dtype=bf16 kv_dtype=auto //; s/heads=32\/8 //; s/block_size=16 //; s/splits_workspace_MB=[0-9.]+//'
