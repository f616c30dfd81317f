#!/usr/bin/env bash
# The streaming benchmark's smoke test on the CPU (no GPU needed): the tiny preset as a store,
# then every row of tools/gpu/bench_stream.sh's table at small token counts, with a budget
# between the all-streamed minimum and all resident so the cost model has a choice to make.
# Checks only that it runs and prints its rows; timings on a CPU mean nothing.
#
# Usage: tools/bench_stream_smoke.sh OUT_DIR   (LORASTREAM_BUILD_DIR: the build, default build/)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:?usage: bench_stream_smoke.sh OUT_DIR}"
BIN="${LORASTREAM_BUILD_DIR:-$ROOT/build}/bin"
NAME="bench-smoke-$$"
mkdir -p "$OUT"
CKPT="$OUT/tiny"
export LORASTREAM_CACHE_DIR="$OUT/cache"
[[ -f "$CKPT/config.json" ]] ||
  "$BIN/lorastream-synth" --preset tiny --out "$CKPT" --presets-dir "$ROOT/configs/models" >/dev/null
"$BIN/lorastream-store" serve "$CKPT" --name "$NAME" > "$OUT/store.log" 2>&1 &
STORE_PID=$!
trap 'kill -TERM $STORE_PID 2>/dev/null; wait $STORE_PID 2>/dev/null || true' EXIT
for _ in $(seq 300); do
  grep -q '^published' "$OUT/store.log" && break
  kill -0 "$STORE_PID" 2>/dev/null || { echo "store exited:"; cat "$OUT/store.log"; exit 1; }
  sleep 0.2
done
"$BIN/lorastream-bench-stream" --store "$NAME" --out "$OUT" --device cpu --tokens 16,32 \
  --swap 3 --ring 1 --budget "${SMOKE_BUDGET:-537771008}" --budget-tokens 32 --steps 2 --warmup 1 \
  --rank 4 2>&1 | tee "$OUT/bench.log"
rc=${PIPESTATUS[0]}
grep -q '| 32 | budget' "$OUT/bench_stream.md" || { echo "smoke: no budget row"; exit 1; }
grep -q 'timeline' "$OUT/bench_stream.md" || { echo "smoke: no timeline row"; exit 1; }
exit "$rc"
