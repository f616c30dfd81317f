#!/usr/bin/env bash
# The store's memory and load time for a compressed base against bf16: serves one synthetic
# checkpoint once per format (--quantize none, fp8, nf4; fp8-head / nf4-head: with
# --quantize-head, the LM head compressed too; fp8-all / nf4-all: with --quantize-embedding
# as well; $LORASTREAM_BENCH_QUANT_FORMATS chooses, none first),
# attaches READERS processes to each store (`lorastream-store verify --hold`: every page
# read, then held), and prints one table: the store's bytes and its blocks' (what --quantize
# compresses; the embedding and the LM head stay bf16 unless asked) against bf16's, the PSS summed over the store and every reader's mappings of its
# segments (`lorastream-store ls`: the RAM the store takes, each page counted once), and the
# load's phases from serve's `published` line: reading (copy + checksums), quantising, and the
# whole serve (checks, allocation, quantising, reading), each against plain loading.
# Usage: tools/bench_store_quant.sh [BUILD_DIR] [PRESET] [LAYERS] [READERS] [OUT_DIR]
#   defaults: build, llama-3-8b, 16, 4, none (about 9.1 GB of bf16 weights: that much free in
#   /tmp for the checkpoint and in /dev/shm for the bf16 store). CPU smoke run:
#   tools/bench_store_quant.sh build llama-3-8b 1 2   (2.5 GB)
#   With OUT_DIR the table also goes to OUT_DIR/bench_store_quant.md and each serve's log
#   beside it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${1:-$ROOT/build}"
PRESET="${2:-llama-3-8b}"
LAYERS="${3:-16}"
READERS="${4:-4}"
OUT="${5:-}"
BIN="$BUILD/bin"
CKPT="${LORASTREAM_BENCH_DIR:-/tmp/lorastream-bench}/$PRESET-$LAYERS"
WORK=$(mktemp -d)
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT

if [[ ! -f "$CKPT/config.json" ]]; then
  "$BIN/lorastream-synth" --preset "$PRESET" --layers "$LAYERS" --out "$CKPT" \
    --presets-dir "$ROOT/configs/models" --force >&2
fi
cat "$CKPT"/*.safetensors > /dev/null  # into the page cache: we measure the store, not the disk

# shellcheck source=tools/store_bench.sh
source "$ROOT/tools/store_bench.sh"  # wait_for_line, store_listing, store_figures

FORMATS=(${LORASTREAM_BENCH_QUANT_FORMATS:-none fp8 nf4 fp8-head nf4-head fp8-all nf4-all})
[[ "${FORMATS[0]}" == none ]] || { echo "the formats must start with none (the baseline)" >&2; exit 1; }
declare -A ROW
for q in "${FORMATS[@]}"; do
  name="benchq-$$-$q"
  rest_flags=()
  [[ "$q" != *-head ]] || rest_flags=(--quantize-head)
  [[ "$q" != *-all ]] || rest_flags=(--quantize-head --quantize-embedding)
  "$BIN/lorastream-store" serve "$CKPT" --name "$name" --quantize "${q%-*}" "${rest_flags[@]}" \
    > "$WORK/serve-$q.out" 2> "$WORK/serve-$q.log" &
  store_pid=$!
  PIDS=("$store_pid")
  wait_for_line "$WORK/serve-$q.out" '^published' "$store_pid"
  line=$(grep '^published' "$WORK/serve-$q.out")
  field() { sed -n "s/.* $1=\([^ ]*\).*/\1/p" <<< "$line"; }
  for r in $(seq "$READERS"); do
    "$BIN/lorastream-store" verify --name "$name" --threads 1 --hold > "$WORK/reader-$q-$r.out" 2>&1 &
    PIDS+=($!)
  done
  for r in $(seq "$READERS"); do
    wait_for_line "$WORK/reader-$q-$r.out" '^holding' "${PIDS[$r]}"
  done
  store_listing "$BIN" "$name" > "$WORK/ls-$q.txt"
  read -r store_bytes block_bytes pss_bytes mapping < <(store_figures "$WORK/ls-$q.txt")
  [[ "$mapping" == $((READERS + 1)) ]] || { echo "$q: $mapping processes map the store, not $((READERS + 1))" >&2; exit 1; }
  ROW[$q]="$store_bytes $block_bytes $pss_bytes $(field load_s) $(field quantize_s) $(field total_s)"
  for pid in "${PIDS[@]}"; do kill -TERM "$pid"; done
  for pid in "${PIDS[@]}"; do wait "$pid" || true; done
  PIDS=()
  [[ -z "$OUT" ]] || { mkdir -p "$OUT"; cp "$WORK/serve-$q.log" "$OUT/bench_store_quant_serve_$q.log"; }
done

table() {
  echo "$PRESET, $LAYERS layers ($CKPT), $READERS readers attached to each store, $(nproc) cores; $(date -u +%F)"
  echo
  echo "| format | store bytes | x bf16 | blocks bytes | x bf16 | PSS (store + $READERS readers) | x bf16 | PSS / store | reading s | quantising s | reading + quantising s | x plain reading | serve total s | x plain total |"
  echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
  read -r b_store b_blocks _ b_load _ b_total <<< "${ROW[none]}"
  for q in "${FORMATS[@]}"; do
    read -r store blocks pss load quant total <<< "${ROW[$q]}"
    awk -v q="$q" -v s="$store" -v bs="$b_store" -v k="$blocks" -v bk="$b_blocks" -v p="$pss" \
        -v l="$load" -v qt="$quant" -v bl="$b_load" -v t="$total" -v bt="$b_total" 'BEGIN {
      printf "| %s | %.0f | %.3f | %.0f | %.3f | %.0f | %.3f | %.3f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f |\n",
        q, s, s / bs, k, k / bk, p, p / bs, p / s, l, qt, l + qt, (l + qt) / bl, t, t / bt }'
  done
  echo
  echo "x bf16: against the plain (bf16) store; PSS: summed over the store's and the readers' mappings of its"
  echo "segments (lorastream-store ls); reading: copy + checksums; serve total: weight check, allocation,"
  echo "quantising and reading, from the first file opened to the manifest published."
}
if [[ -n "$OUT" ]]; then table | tee "$OUT/bench_store_quant.md"; else table; fi
