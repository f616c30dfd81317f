#!/usr/bin/env bash
# Rewrites every C++ and CUDA file of the repository as .clang-format says (tools/test.sh
# checks that nothing differs). Usage: tools/format.sh [--check]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mapfile -t files < <(git ls-files '*.h' '*.cc' '*.cu')
if [[ "${1:-}" == "--check" ]]; then
  exec clang-format --dry-run --Werror "${files[@]}"
fi
clang-format -i "${files[@]}"
