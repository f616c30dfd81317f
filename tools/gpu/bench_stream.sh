#!/usr/bin/env bash
# The streaming engine's benchmark on a CUDA machine (tools/gpu/build_and_test.sh runs it as
# the step `bench`): synthesises a 16-layer llama-3-8b-shaped checkpoint (bf16, ~9 GB; kept in
# $LORASTREAM_BENCH_DIR between runs), serves it as a store, and runs lorastream-bench-stream:
# batch 1 at 512, 2048 and 8192 tokens, rank 16 on all seven projections: fully resident;
# fully resident with every block taped (no recompute); 12 of 16 blocks streamed through a
# ring of 2 (one ring for the whole step); the same on the memory timeline at that plan's
# estimated peak (more slots in the forward and backward, taped blocks); the cost model's
# choice within that peak; and
# at 2048 tokens the cost model's choice for an 8 GiB budget next to the best hand-picked
# (blocks_to_swap, ring_size) plan of rings 1-4 that fits 8 GiB. Every row: measured and
# predicted step, bytes copied per step, measured and estimated peak, floor.
# Results: OUT/bench_stream.md (the table and the command), bench_stream.jsonl (every step's
# statistics), bench_stream.log, bench_store.log. The CPU smoke test of the same binary:
# tools/bench_stream_smoke.sh.
#
# Usage: tools/gpu/bench_stream.sh OUT_DIR [extra lorastream-bench-stream options]
#   LORASTREAM_BUILD_DIR   the build (default build/, tools/setup.sh's)
#   LORASTREAM_BENCH_QUANTIZE  none (default) | fp8 | nf4: the store's --quantize
#   LORASTREAM_BENCH_STORE_ARGS  more of serve's options (e.g. --quantize-head)
#   LORASTREAM_BENCH_PRESET, _LAYERS, _DEVICE, _ARGS   the model (llama-3-8b, 16 layers), the
#     device (cuda:0) and the benchmark's options in place of the defaults below (the CPU
#     smoke test, tools/bench_stream_smoke.sh, sets them)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${1:?usage: bench_stream.sh OUT_DIR [options]}"
shift
BIN="${LORASTREAM_BUILD_DIR:-$ROOT/build}/bin"
PRESET="${LORASTREAM_BENCH_PRESET:-llama-3-8b}"
LAYERS="${LORASTREAM_BENCH_LAYERS:-16}"
DEVICE="${LORASTREAM_BENCH_DEVICE:-cuda:0}"
read -r -a ARGS <<< "${LORASTREAM_BENCH_ARGS:---tokens 512,2048,8192 --swap 12 --ring 2 --budget 8GiB --budget-tokens 2048 --steps 6 --warmup 2}"
NAME="bench-stream-$$"
mkdir -p "$OUT"
# shellcheck source=tools/gpu/bench_store_up.sh
source "$ROOT/tools/gpu/bench_store_up.sh"

"$BIN/lorastream-bench-stream" --store "$NAME" --out "$OUT" --device "$DEVICE" "${ARGS[@]}" "$@" \
  2>&1 | tee "$OUT/bench_stream.log"
exit "${PIPESTATUS[0]}"
