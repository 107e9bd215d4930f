#!/usr/bin/env bash
# One device call for a session's engine checks: build (unless --no-build), a pytest selection,
# and `pyorch bench` sets through bench/gpu_check.sh, everything packed into OUT/NAME.tgz so
# the device's limit on returned files (8) never drops a log.
#
#   bash bench/probes/session_check.sh OUT NAME [--no-build] [--tests "PATHS"] [--sets a,b] [--trace]
set -uo pipefail
OUT=${1:?usage: bash bench/probes/session_check.sh OUT NAME [...]}; NAME=${2:?}; shift 2
BUILD=1 TESTS="" SETS="" TRACE=""
while [ $# -gt 0 ]; do
  case "$1" in
    --no-build) BUILD=0 ;;
    --tests) TESTS="$2"; shift ;;
    --sets) SETS="$2"; shift ;;
    --trace) TRACE=1 ;;
  esac
  shift
done
cd "$(dirname "$0")/../.."
W="$OUT/$NAME"; mkdir -p "$W"
export PYTHONUNBUFFERED=1
if [ "$BUILD" = 1 ]; then
  bash bench/gpu_check.sh "$W" --no-tests --no-bench 2>&1 | tail -4
fi
if [ -n "$TESTS" ]; then
  # shellcheck disable=SC2086
  timeout "${TESTS_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -rs $TESTS \
    > "$W/tests.log" 2>&1
  tail -3 "$W/tests.log"; grep -E "^(FAILED|ERROR)" "$W/tests.log" | head -20
fi
if [ -n "$SETS" ]; then
  ENGINE_SKIP_HF=1 ENGINE_STEP_TRACE=$TRACE bash bench/gpu_check.sh "$W" --no-build --no-tests \
    --no-bench --engine-bench "${MODEL:-.models/llama3-8b-dummy}" --engine-sets "$SETS"
fi
tar czf "$OUT/$NAME.tgz" -C "$OUT" "$NAME" && rm -rf "$W"
