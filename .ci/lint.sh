#!/usr/bin/env bash
# Lint: ruff and mypy on pyorch/ (configured in pyproject.toml), clang-format on the C++/CUDA
# sources (.clang-format). Runs every check, then exits non-zero if any of them failed.
# Needs ruff, mypy and clang-format on PATH (requirements-ci.txt; `make lint` puts .venv first).
set -uo pipefail
cd "$(dirname "$0")/.."

failed=()

echo "== ruff check pyorch"
ruff check --output-format concise pyorch || failed+=(ruff)

echo "== mypy pyorch"
mypy pyorch || failed+=(mypy)

echo "== clang-format --dry-run --Werror (cpp/ cuda/ bench/cpp/)"
mapfile -t sources < <(find cpp cuda bench/cpp -type f \
  \( -name '*.c' -o -name '*.cc' -o -name '*.cpp' -o -name '*.cu' -o -name '*.cuh' -o -name '*.h' \
     -o -name '*.hpp' \) | sort)
if ((${#sources[@]} == 0)); then
  echo "no C++/CUDA sources found" >&2
  failed+=(clang-format)
else
  bad=0
  for f in "${sources[@]}"; do
    if ! out=$(clang-format --dry-run --Werror "$f" 2>&1); then
      echo "$f: $(grep -c ': error:' <<<"$out") places to reformat"
      bad=$((bad + 1))
    fi
  done
  echo "clang-format: $bad of ${#sources[@]} files need formatting" \
       "(see them: clang-format --dry-run FILE; fix: clang-format -i FILE)"
  ((bad == 0)) || failed+=(clang-format)
fi

if ((${#failed[@]})); then
  echo "lint failed: ${failed[*]}" >&2
  exit 1
fi
echo "lint passed"
