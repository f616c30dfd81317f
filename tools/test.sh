#!/usr/bin/env bash
# The README's test command: installs what is missing, builds (tools/setup.sh), runs every CPU
# test through CTest, the `gpu` tests too on a CUDA build with a GPU, then builds the
# libFuzzer targets with clang and runs each for a bounded time.
# Usage: tools/test.sh [ctest args...]     (LORASTREAM_FUZZ_SECONDS=0 skips fuzzing)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${LORASTREAM_BUILD_DIR:-$ROOT/build}"
FUZZ_SECONDS="${LORASTREAM_FUZZ_SECONDS:-30}"

start=$(date +%s)
"$ROOT/tools/setup.sh"
echo "test: built in $(( $(date +%s) - start )) s"

# Tests that need a GPU carry the `gpu` label: run after the CPU tests on a CUDA build on a
# machine with a GPU (a CPU build has none).
(cd "$BUILD_DIR" && ctest --output-on-failure -LE gpu -j1 "$@")
if grep -q "LORASTREAM_BUILD_CUDA 1" "$BUILD_DIR/generated/lorastream_build_config.h" &&
   { nvidia-smi -L 2>/dev/null | grep -q '^GPU '; }; then
  echo "test: CUDA build and a GPU: running the gpu tests"
  (cd "$BUILD_DIR" && ctest --output-on-failure -L gpu -j1 "$@")
fi

if [[ "$FUZZ_SECONDS" != "0" ]] && ! command -v clang++ >/dev/null; then
  echo "test: no clang++ here (setup installs it only with Debian's LibTorch): fuzzing skipped"
elif [[ "$FUZZ_SECONDS" != "0" ]]; then
  FUZZ_DIR="$BUILD_DIR-fuzz"
  if [[ ! -f "$FUZZ_DIR/build.ninja" ]]; then
    CC=clang CXX=clang++ cmake -S "$ROOT" -B "$FUZZ_DIR" -G Ninja -DLORASTREAM_FUZZ=ON \
      -DCMAKE_BUILD_TYPE=RelWithDebInfo
  fi
  cmake --build "$FUZZ_DIR" -j"$(nproc)"
  for fuzzer in "$FUZZ_DIR"/bin/fuzz_*; do
    name=$(basename "$fuzzer")
    corpus="$FUZZ_DIR/corpus/$name"; mkdir -p "$corpus"
    seeds="$ROOT/fuzz/seeds/${name#fuzz_}"
    echo "test: fuzzing $name for ${FUZZ_SECONDS}s"
    "$fuzzer" -max_total_time="$FUZZ_SECONDS" -rss_limit_mb=2048 -max_len=65536 \
      -print_final_stats=1 "$corpus" $( [[ -d "$seeds" ]] && echo "$seeds" ) 2>&1 | tail -n 12
  done
fi
echo "test: all passed in $(( $(date +%s) - start )) s"
