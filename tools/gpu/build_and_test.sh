#!/usr/bin/env bash
# On a CUDA machine: builds lorastream through tools/setup.sh (which picks python3's CUDA
# torch and, without network, the .deb folder of tools/gpu/gather_debs.sh), then runs the
# steps named in LORASTREAM_GPU_STEPS, writing every result into one folder.
#
# Usage: tools/gpu/build_and_test.sh OUT_DIR
#   LORASTREAM_GPU_STEPS  comma list of: test (gpu tests), cputest (every other test),
#                         bench (tools/gpu/bench_stream.sh), parity (tools/parity/run_all.sh),
#                         store (tools/bench_store.sh), storequant
#                         (tools/bench_store_quant.sh: the store's bytes, PSS with 4 readers
#                         and load + quantise time for fp8 and nf4 against bf16, 16-layer
#                         llama-3-8b), group (tools/gpu/bench_group.sh:
#                         job groups on one GPU), multi (tools/gpu/bench_multi_gpu.py:
#                         two GPUs, one store, two jobs), quant (tools/gpu/quant_report.sh:
#                         fp8 and nf4 bases against bf16; everything resident with each
#                         store, bench_stream.sh --swap 0; tools/parity/quant_fixtures.py
#                         into OUT/quant_fixtures, checked by the worker's quantised parity
#                         test), flux (tools/gpu/bench_flux.sh: FLUX.1-dev's shape resident
#                         and streamed within 8 GiB, with diffusers + peft from
#                         .diffusers/src when there; FLUX_BENCH_QUANTIZE=fp8|nf4: both again
#                         on a compressed store), moe (tools/gpu/bench_moe.sh: a 16-layer
#                         Qwen3-30B-A3B-shaped model at 2048 tokens resident against
#                         transformers + peft, streamed within 24 GiB against its PCIe floor,
#                         and 4 jobs as one group; MOE_BENCH_*: see the script),
#                         qwen_image (tools/gpu/bench_qwen_image.sh: all 60 blocks at 1024x1024
#                         resident against diffusers + peft, within 24 GiB, "auto", a group
#                         of 4 at 512x512, and 45 of 60 streamed beside musubi-tuner's
#                         streaming where .musubi/ holds its offloader; QI_BENCH_*: see the
#                         script). Default: test
#   LORASTREAM_GPU_TARGETS  build only these targets (default: all)
#   LORASTREAM_BUILD_DIR  build folder (default: build/); LORASTREAM_BUILD_TYPE (default
#                         here: Release); LORASTREAM_DEBS, LORASTREAM_LIBTORCH: see setup.sh
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${1:?usage: build_and_test.sh OUT_DIR}"
STEPS="${LORASTREAM_GPU_STEPS:-test}"
export LORASTREAM_BUILD_DIR="${LORASTREAM_BUILD_DIR:-$ROOT/build}"
export LORASTREAM_BUILD_TYPE="${LORASTREAM_BUILD_TYPE:-Release}"
BUILD="$LORASTREAM_BUILD_DIR"
mkdir -p "$OUT"
LOG="$OUT/gpu_build_and_test.log"
exec > >(tee -a "$LOG") 2>&1

step() { echo; echo "=== $* ($(date +%T))"; }

step "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
nproc; free -g | head -2; df -h /dev/shm | tail -1; ulimit -l

step "set up + build (tools/setup.sh)"
start=$(date +%s)
LORASTREAM_TARGETS="${LORASTREAM_GPU_TARGETS:-}" "$ROOT/tools/setup.sh" || exit 1
echo "build: $(( $(date +%s) - start )) s on $(nproc) cores"
if ! grep -q "LORASTREAM_BUILD_CUDA 1" "$BUILD/generated/lorastream_build_config.h"; then
  echo "not a CUDA build: see the setup line above for why and the command that fixes it"
  exit 1
fi

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
    storequant)
      step "compressed stores: bytes, PSS and load time against bf16"
      "$ROOT/tools/bench_store_quant.sh" "$BUILD" llama-3-8b 16 4 "$OUT" || status=1 ;;
    group)
      step "job groups on one GPU"
      "$ROOT/tools/gpu/bench_group.sh" "$OUT" || status=1 ;;
    flux)
      step "FLUX.1 resident and streamed"
      "$ROOT/tools/gpu/bench_flux.sh" "$OUT" || status=1 ;;
    moe)
      step "mixture of experts: resident, streamed, grouped, transformers + peft"
      "$ROOT/tools/gpu/bench_moe.sh" "$OUT" || status=1 ;;
    qwen_image)
      step "Qwen-Image: resident, streamed, auto, a group at 512x512, diffusers + peft"
      "$ROOT/tools/gpu/bench_qwen_image.sh" "$OUT" || status=1 ;;
    multi)
      step "several GPUs, one store"
      python3 "$ROOT/tools/gpu/bench_multi_gpu.py" "$OUT" || status=1 ;;
    quant)
      step "compressed bases: quality report and parity fixtures"
      "$ROOT/tools/gpu/quant_report.sh" "$OUT" || status=1
      # Everything resident: the compressed blocks kept compressed on the GPU (the engine's
      # "swap 0 ring 1" row) against the bf16 store's, at 512 and 2048 tokens.
      for q in none fp8 nf4; do
        LORASTREAM_BENCH_QUANTIZE=$q LORASTREAM_BENCH_ARGS="--tokens 512,2048 --swap 0 --ring 1 \
--quick --steps 6 --warmup 2" "$ROOT/tools/gpu/bench_stream.sh" "$OUT/quant_resident_$q" \
          > "$OUT/quant_resident_$q.log" 2>&1 || status=1
        echo "$q:"; grep -F '| swap 0 ring 1 |' "$OUT/quant_resident_$q/bench_stream.md" || true
      done
      python3 "$ROOT/tools/parity/quant_fixtures.py" --bin "$BUILD/bin" \
        --out "$OUT/quant_fixtures" 2>&1 | tee "$OUT/quant_fixtures.log"
      [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
      LORASTREAM_QUANT_FIXTURES="$OUT/quant_fixtures" "$BUILD/bin/worker_tests" \
        "parity on a compressed store against transformers + peft (fixtures)" \
        2>&1 | tail -60 | tee "$OUT/quant_parity.log"
      [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1 ;;
    *) echo "unknown step $s"; status=1 ;;
  esac
done
step "done (status $status)"
exit $status
