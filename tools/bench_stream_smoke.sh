#!/usr/bin/env bash
# The streaming benchmark's smoke test on the CPU (no GPU needed): tools/gpu/bench_stream.sh
# itself, with the tiny preset as the store and small token counts, a budget between the
# all-streamed minimum and all resident (the memory model's 512 MiB reserve plus about 1.4 MB
# for the tiny model) so the cost model has a choice to make. Checks that every kind of row is
# printed; timings on a CPU mean nothing.
#
# Usage: tools/bench_stream_smoke.sh OUT_DIR   (LORASTREAM_BUILD_DIR: the build, default build/)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:?usage: bench_stream_smoke.sh OUT_DIR}"
mkdir -p "$OUT"
export LORASTREAM_BUILD_DIR="${LORASTREAM_BUILD_DIR:-$ROOT/build}"
export LORASTREAM_BENCH_DIR="$OUT/models" LORASTREAM_CACHE_DIR="$OUT/cache"
export LORASTREAM_BENCH_PRESET=tiny LORASTREAM_BENCH_LAYERS=4 LORASTREAM_BENCH_DEVICE=cpu
export LORASTREAM_BENCH_ARGS="--tokens 16,32 --swap 3 --ring 1 --rank 4 --budget ${SMOKE_BUDGET:-538300000} --budget-tokens 32 --steps 2 --warmup 1"
"$ROOT/tools/gpu/bench_stream.sh" "$OUT"
for row in '| 16 | resident' '| 32 | swap 3 ring 1 |' 'ring 1 timeline' '| 32 | budget' '| 32 | hand swap'; do
  grep -qF "$row" "$OUT/bench_stream.md" || { echo "smoke: no row \"$row\""; exit 1; }
done
echo "smoke: every row printed"
