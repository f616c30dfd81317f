#!/usr/bin/env bash
# Load throughput of `lorastream-store serve` from page-cached files against a plain memcpy of
# the same bytes on the same machine. Prints one table row per thread count.
# Usage: tools/bench_store.sh [BUILD_DIR] [PRESET] [LAYERS]
#   defaults: build, llama-3-8b, 4   (about 3.9 GB of bf16 weights; needs that much free
#   in /tmp for the checkpoint and in /dev/shm for the store)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${1:-$ROOT/build}"
PRESET="${2:-llama-3-8b}"
LAYERS="${3:-4}"
BIN="$BUILD/bin"
CKPT="${LORASTREAM_BENCH_DIR:-/tmp/lorastream-bench}/$PRESET-$LAYERS"

if [[ ! -f "$CKPT/config.json" ]]; then
  "$BIN/lorastream-synth" --preset "$PRESET" --layers "$LAYERS" --out "$CKPT" >&2
fi
cat "$CKPT"/*.safetensors > /dev/null  # into the page cache: we measure copying, not the disk
BYTES=$(du -cb "$CKPT"/*.safetensors | tail -1 | cut -f1)

printf "%-8s %-12s %-8s %-11s %-11s %-7s | %-11s %-12s %-16s %-7s\n" threads store_bytes load_s load_GB/s memcpy_GB/s ratio prefault_s serve_total_s cold_memcpy_GB/s ratio
for threads in 1 $(nproc); do
  name="bench-$$-$threads"
  out=$(mktemp)
  "$BIN/lorastream-store" serve "$CKPT" --name "$name" --threads "$threads" --no-lock > "$out" 2>/dev/null &
  pid=$!
  for _ in $(seq 600); do grep -q '^published' "$out" && break; sleep 0.1; done
  line=$(grep '^published' "$out" || true)
  kill -TERM "$pid"; wait "$pid" || true; rm -f "$out"
  [[ -n "$line" ]] || { echo "serve did not publish" >&2; exit 1; }
  field() { sed -n "s/.* $1=\([^ ]*\).*/\1/p" <<< "$line"; }
  store_bytes=$(field bytes)
  load_s=$(field load_s); serve_gbps=$(field load_gbps); prefault_s=$(field prefault_s)
  mline=$("$BIN/lorastream-memcpy-bench" "$store_bytes" "$threads")
  memcpy_gbps=$(sed -n 's/.* gbps=\([^ ]*\).*/\1/p' <<< "$mline")
  cold_gbps=$(sed -n 's/.*cold_gbps=\([^ ]*\).*/\1/p' <<< "$mline")
  ratio=$(awk -v a="$serve_gbps" -v b="$memcpy_gbps" 'BEGIN { printf "%.2f", a / b }')
  total_s=$(awk -v a="$load_s" -v b="$prefault_s" 'BEGIN { printf "%.3f", a + b }')
  ratio_cold=$(awk -v n="$store_bytes" -v t="$total_s" -v b="$cold_gbps" 'BEGIN { printf "%.2f", n / t / 1e9 / b }')
  printf "%-8s %-12s %-8s %-11s %-11s %-7s | %-11s %-12s %-16s %-7s\n" "$threads" "$store_bytes" "$load_s" "$serve_gbps" "$memcpy_gbps" "$ratio" "$prefault_s" "$total_s" "$cold_gbps" "$ratio_cold"
done
echo "checkpoint: $CKPT ($BYTES bytes of safetensors, page-cached)"
echo "load = serve's copy from the page cache into prefaulted shm + checksums; memcpy = best of 3 between prefaulted buffers"
echo "right: prefault = creating + reserving + prefaulting the segments; cold memcpy = into a fresh buffer (page faults included)"
