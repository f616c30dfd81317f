#!/usr/bin/env bash
# The streaming engine's benchmark on a CUDA machine (tools/gpu/build_and_test.sh runs it as
# the step `bench`): synthesises a 16-layer llama-3-8b-shaped checkpoint (bf16, ~9 GB; kept in
# $LORASTREAM_BENCH_DIR between runs), serves it as a store, and runs lorastream-bench-stream:
# batch 1 at 2048 and 8192 tokens, rank 16 on all seven projections, fully resident against
# 12 of 16 blocks streamed through a ring of 2, plus a run planned from an 8 GiB budget at
# 2048 tokens. Results: OUT/bench_stream.md (the table and the command), bench_stream.jsonl
# (every step's statistics), bench_stream.log, bench_store.log.
#
# Usage: tools/gpu/bench_stream.sh OUT_DIR [extra lorastream-bench-stream options]
#   LORASTREAM_BUILD_DIR  the build (default build/, tools/setup.sh's)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${1:?usage: bench_stream.sh OUT_DIR [options]}"
shift
BIN="${LORASTREAM_BUILD_DIR:-$ROOT/build}/bin"
CKPT="${LORASTREAM_BENCH_DIR:-/tmp/lorastream-bench}/llama-3-8b-16"
NAME="bench-stream-$$"
mkdir -p "$OUT"

if [[ ! -f "$CKPT/config.json" ]]; then
  "$BIN/lorastream-synth" --preset llama-3-8b --layers 16 --out "$CKPT" --presets-dir "$ROOT/configs/models"
fi
"$BIN/lorastream-store" serve "$CKPT" --name "$NAME" > "$OUT/bench_store.log" 2>&1 &
STORE_PID=$!
trap 'kill -TERM $STORE_PID 2>/dev/null; wait $STORE_PID 2>/dev/null || true' EXIT
for _ in $(seq 3000); do
  grep -q '^published' "$OUT/bench_store.log" && break
  kill -0 "$STORE_PID" 2>/dev/null || { echo "store exited:"; cat "$OUT/bench_store.log"; exit 1; }
  sleep 0.2
done
grep -q '^published' "$OUT/bench_store.log" || { echo "store did not publish in 10 min"; exit 1; }

"$BIN/lorastream-bench-stream" --store "$NAME" --out "$OUT" --device cuda:0 \
  --tokens 2048,8192 --swap 12 --ring 2 --budget 8GiB --budget-tokens 2048 \
  --steps 6 --warmup 2 "$@" 2>&1 | tee "$OUT/bench_stream.log"
exit "${PIPESTATUS[0]}"
