#!/usr/bin/env bash
# On a CUDA machine without network (CUDA in /usr/local/cuda, python3 with a CUDA torch
# wheel): unpacks the .deb files gathered by tools/gpu/gather_debs.sh under /tmp/deps (never
# into /), builds lorastream against the wheel's LibTorch, runs the tests labelled `gpu`,
# then the steps named in LORASTREAM_GPU_STEPS, writing every result into one folder.
#
# Usage: tools/gpu/build_and_test.sh OUT_DIR
#   LORASTREAM_GPU_STEPS  comma list of: test (gpu tests), cputest (every other test),
#                         bench (tools/gpu/bench_stream.sh), parity (tools/parity/run_all.sh),
#                         store (tools/bench_store.sh), multi (tools/gpu/bench_multi_gpu.py:
#                         two GPUs, one store, two jobs). Default: test
#   LORASTREAM_GPU_TARGETS  build only these targets (default: all)
#   LORASTREAM_DEBS       the .deb folder (default: .debs in the repo)
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${1:?usage: build_and_test.sh OUT_DIR}"
STEPS="${LORASTREAM_GPU_STEPS:-test}"
DEBS="${LORASTREAM_DEBS:-$ROOT/.debs}"
BUILD=/tmp/lorastream-build
DEPS=/tmp/deps
mkdir -p "$OUT"
LOG="$OUT/gpu_build_and_test.log"
exec > >(tee -a "$LOG") 2>&1

step() { echo; echo "=== $* ($(date +%T))"; }

step "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
nproc; free -g | head -2; df -h /dev/shm | tail -1; ulimit -l

step "unpack deps"
mkdir -p "$DEPS"
for f in "$DEBS"/*.deb; do dpkg -x "$f" "$DEPS"; done
export PATH=/usr/local/cuda/bin:$PATH
TORCH_PREFIX=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')
TORCH_LIB=$(python3 -c 'import torch,os;print(os.path.join(os.path.dirname(torch.__file__),"lib"))')
export LD_LIBRARY_PATH="$DEPS/usr/lib/x86_64-linux-gnu:$TORCH_LIB:${LD_LIBRARY_PATH:-}"

step "configure + build"
start=$(date +%s)
cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc -DCUDAToolkit_ROOT=/usr/local/cuda \
  -DCMAKE_CUDA_ARCHITECTURES=90 -DTORCH_CUDA_ARCH_LIST=9.0 \
  -DCMAKE_PREFIX_PATH="$TORCH_PREFIX;$DEPS/usr" \
  -DCMAKE_EXE_LINKER_FLAGS="-Wl,-rpath-link,$DEPS/usr/lib/x86_64-linux-gnu" \
  -DCMAKE_SHARED_LINKER_FLAGS="-Wl,-rpath-link,$DEPS/usr/lib/x86_64-linux-gnu" || exit 1
cmake --build "$BUILD" -j"$(nproc)" ${LORASTREAM_GPU_TARGETS:+--target $LORASTREAM_GPU_TARGETS} -- -k 0 || exit 1
echo "build: $(( $(date +%s) - start )) s on $(nproc) cores"
export LORASTREAM_BUILD_DIR="$BUILD"

status=0
IFS=',' read -ra steps <<< "$STEPS"
for s in "${steps[@]}"; do
  case "$s" in
    test)
      step "gpu tests"
      (cd "$BUILD" && ctest -L gpu --output-on-failure -V) || status=1 ;;
    cputest)
      step "cpu tests"
      (cd "$BUILD" && ctest -LE gpu --output-on-failure) || status=1 ;;
    bench)
      step "streaming benchmark"
      "$ROOT/tools/gpu/bench_stream.sh" "$OUT" || status=1 ;;
    parity)
      step "parity harness"
      "$ROOT/tools/parity/run_all.sh" "$OUT" || status=1 ;;
    store)
      step "store benchmark"
      "$ROOT/tools/bench_store.sh" "$BUILD" llama-3-8b 4 | tee "$OUT/bench_store_ratio.txt" || status=1 ;;
    multi)
      step "several GPUs, one store"
      python3 "$ROOT/tools/gpu/bench_multi_gpu.py" "$OUT" || status=1 ;;
    *) echo "unknown step $s"; status=1 ;;
  esac
done
step "done (status $status)"
exit $status
