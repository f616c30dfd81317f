#!/usr/bin/env bash
# Job groups' benchmark on a CUDA machine (tools/gpu/bench_group.py says what it runs and
# prints): serves the 16-layer llama-3-8b-shaped store of bench_stream.sh, then runs groups of
# 1, 2, 4 (and 8) jobs, four jobs one after another and four processes side by side.
# Results: OUT/bench_group.md (the table and the command), bench_group.json, OUT/group/.
#
# Usage: tools/gpu/bench_group.sh OUT_DIR [extra bench_group.py options]
#   LORASTREAM_BUILD_DIR, LORASTREAM_BENCH_DIR, LORASTREAM_BENCH_PRESET, _LAYERS, _DEVICE:
#   as for bench_stream.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${1:?usage: bench_group.sh OUT_DIR [options]}"
shift
BIN="${LORASTREAM_BUILD_DIR:-$ROOT/build}/bin"
PRESET="${LORASTREAM_BENCH_PRESET:-llama-3-8b}"
LAYERS="${LORASTREAM_BENCH_LAYERS:-16}"
DEVICE="${LORASTREAM_BENCH_DEVICE:-cuda:0}"
NAME="bench-group-$$"
mkdir -p "$OUT"
# shellcheck source=tools/gpu/bench_store_up.sh
source "$ROOT/tools/gpu/bench_store_up.sh"

python3 "$ROOT/tools/gpu/bench_group.py" --bin "$BIN" --store "$NAME" --out "$OUT" \
  --device "$DEVICE" "$@" 2>&1 | tee "$OUT/bench_group.log"
exit "${PIPESTATUS[0]}"
