#!/usr/bin/env bash
# Compiles the CUDA adapters (cpp/ops/*.cpp) with -fsyntax-only against the installed CPU torch's
# headers and the CUDA toolkit's, so that an adapter error cannot land from a CPU-only machine.
set -euo pipefail
cd "$(dirname "$0")/.."
CUDA_INC="${CUDA_HOME:-/usr/local/cuda}/include"
TORCH_DIR=$(python -c "import torch, os; print(os.path.dirname(torch.__file__))")
ABI=$(python -c "import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))")
PY_INC=$(python -c "import sysconfig; print(sysconfig.get_paths()['include'])")
for f in cpp/ops/*.cpp cpp/torch_bindings.cpp; do
  echo "adapter syntax check: $f"
  g++ -std=c++17 -fsyntax-only -Wall -Werror=return-type -D_GLIBCXX_USE_CXX11_ABI="$ABI" \
    -DPYORCH_WITH_CUDA -Icpp -Icuda/include -isystem cmake/adapter_check \
    -isystem "$TORCH_DIR/include" -isystem "$TORCH_DIR/include/torch/csrc/api/include" \
    -isystem "$CUDA_INC" -isystem "$PY_INC" "$f"
done
