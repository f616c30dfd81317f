# Sourced by the GPU benchmarks (bench_stream.sh, bench_group.sh): synthesises the benchmark's
# checkpoint once ($PRESET with $LAYERS layers, bf16, kept under $LORASTREAM_BENCH_DIR between
# runs) and serves it as the store $NAME until the script exits; its log is
# $OUT/bench_store.log, compressed as $LORASTREAM_BENCH_QUANTIZE says (none, fp8, nf4), with
# $LORASTREAM_BENCH_STORE_ARGS added to serve's arguments (e.g. --quantize-head). Needs
# ROOT, BIN, OUT, PRESET, LAYERS and NAME.
CKPT="${LORASTREAM_BENCH_DIR:-/tmp/lorastream-bench}/$PRESET-$LAYERS"
if [[ ! -f "$CKPT/config.json" ]]; then
  "$BIN/lorastream-synth" --preset "$PRESET" --layers "$LAYERS" --out "$CKPT" --presets-dir "$ROOT/configs/models" --force
fi
"$BIN/lorastream-store" serve "$CKPT" --name "$NAME" --quantize "${LORASTREAM_BENCH_QUANTIZE:-none}" ${LORASTREAM_BENCH_STORE_ARGS:-} > "$OUT/bench_store.log" 2>&1 &
STORE_PID=$!
trap 'kill -TERM $STORE_PID 2>/dev/null; wait $STORE_PID 2>/dev/null || true' EXIT
for _ in $(seq 3000); do
  grep -q '^published' "$OUT/bench_store.log" && break
  kill -0 "$STORE_PID" 2>/dev/null || { echo "store exited:"; cat "$OUT/bench_store.log"; exit 1; }
  sleep 0.2
done
grep -q '^published' "$OUT/bench_store.log" || { echo "store did not publish in 10 min"; exit 1; }
