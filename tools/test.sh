#!/usr/bin/env bash
# The README's test command: installs what is missing, builds (tools/setup.sh), checks that
# every C++ and CUDA file follows .clang-format (tools/format.sh --check), runs every CPU
# test through CTest, the `gpu` tests too on a CUDA build with a GPU, then the torch-free tests
# (common, store, coordinator, the worker's torch-free core) again, built and run under
# AddressSanitizer+UndefinedBehaviorSanitizer and under ThreadSanitizer (their own build
# folders, -DLORASTREAM_WORKER=OFF, so no LibTorch),
# then builds the libFuzzer targets with clang and runs each for a bounded time.
# Usage: tools/test.sh [ctest args...]     (LORASTREAM_FUZZ_SECONDS=0 skips fuzzing;
#        LORASTREAM_SANITIZERS="asan tsan" by default: AddressSanitizer+UBSan, then
#        ThreadSanitizer; "asan" or "tsan" runs one, "" skips both)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="${LORASTREAM_BUILD_DIR:-$ROOT/build}"
FUZZ_SECONDS="${LORASTREAM_FUZZ_SECONDS:-30}"
SANITIZERS="${LORASTREAM_SANITIZERS-asan tsan}"

start=$(date +%s)
"$ROOT/tools/setup.sh"
echo "test: built in $(( $(date +%s) - start )) s"

# One format everywhere: every C++ and CUDA file as .clang-format writes it (tools/format.sh
# rewrites them). Setup installs clang-format with Debian's LibTorch; elsewhere it may be absent.
if command -v clang-format >/dev/null && git -C "$ROOT" rev-parse --git-dir >/dev/null 2>&1; then
  "$ROOT/tools/format.sh" --check ||
    { echo "test: the files above differ from .clang-format: run tools/format.sh" >&2; exit 1; }
  echo "test: every C++ and CUDA file follows .clang-format"
else
  echo "test: no clang-format (or not a git checkout) here: the format check is skipped"
fi

# Tests that need a GPU carry the `gpu` label: run after the CPU tests on a CUDA build on a
# machine with a GPU (a CPU build has none).
(cd "$BUILD_DIR" && ctest --output-on-failure -LE gpu -j1 "$@")
if grep -q "LORASTREAM_BUILD_CUDA 1" "$BUILD_DIR/generated/lorastream_build_config.h" &&
   { nvidia-smi -L 2>/dev/null | grep -q '^GPU '; }; then
  echo "test: CUDA build and a GPU: running the gpu tests"
  (cd "$BUILD_DIR" && ctest --output-on-failure -L gpu -j1 "$@")
fi

# One sanitized build of the torch-free components and their tests, run through CTest.
# -O1 keeps the build affordable on two cores; every finding fails the run, also one in a
# process a test started (a coordinator, a store, a test worker), whose own exit status no
# test may look at: every process writes its reports to DIR/sanitizer-reports/NAME.PID.
sanitized_tests() {
  local name=$1 flags=$2 dir="$BUILD_DIR-$1" began reports failed=0
  began=$(date +%s)
  if [[ ! -f "$dir/build.ninja" ]]; then
    # The main build's dependency prefixes (the .deb folder's, on a machine without apt).
    local prefix
    prefix=$(sed -n 's/^CMAKE_PREFIX_PATH:[A-Z]*=//p' "$BUILD_DIR/CMakeCache.txt" 2>/dev/null || true)
    cmake -S "$ROOT" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=None -DLORASTREAM_WORKER=OFF \
      ${prefix:+-DCMAKE_PREFIX_PATH="$prefix"} \
      -DCMAKE_CXX_FLAGS="-O1 -g -fno-omit-frame-pointer $flags" \
      -DCMAKE_C_FLAGS="-O1 -g -fno-omit-frame-pointer $flags" \
      -DCMAKE_EXE_LINKER_FLAGS="$flags" -DCMAKE_SHARED_LINKER_FLAGS="$flags"
  fi
  cmake --build "$dir" -j"$(nproc)"
  echo "test: $name build took $(( $(date +%s) - began )) s"
  reports="$dir/sanitizer-reports"
  rm -rf "$reports" && mkdir -p "$reports"
  # setarch -R: ThreadSanitizer's shadow memory wants the address layout without ASLR
  # (newer kernels randomise more bits than it allows for); the children inherit it.
  (cd "$dir" && ASAN_OPTIONS="$ASAN_OPTIONS:log_path=$reports/asan" \
     UBSAN_OPTIONS="$UBSAN_OPTIONS:log_path=$reports/ubsan" \
     TSAN_OPTIONS="$TSAN_OPTIONS:log_path=$reports/tsan" \
     setarch "$(uname -m)" -R ctest --output-on-failure -L 'common|store|coordinator|worker_core' \
     -j1 "$@") ||
    failed=1
  if [[ -n "$(ls -A "$reports")" ]]; then
    for report in "$reports"/*; do echo "test: $name report $report:"; cat "$report"; done
    failed=1
  fi
  echo "test: $name build and run took $(( $(date +%s) - began )) s"
  if (( failed )); then echo "test: $name failed" >&2; exit 1; fi
}
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:strict_string_checks=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export LSAN_OPTIONS="suppressions=$ROOT/tools/lsan.supp:print_suppressions=0"
export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$ROOT/tools/tsan.supp"
for sanitizer in $SANITIZERS; do
  case "$sanitizer" in
    asan) sanitized_tests asan "-fsanitize=address,undefined -fno-sanitize-recover=undefined" "$@" ;;
    tsan) sanitized_tests tsan "-fsanitize=thread" "$@" ;;
    *) echo "test: unknown sanitizer '$sanitizer' (asan, tsan)" >&2; exit 2 ;;
  esac
done

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
