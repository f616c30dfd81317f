#!/usr/bin/env bash
# The parity harness, one command (on a CUDA machine with python3, torch, transformers, peft,
# safetensors; run by tools/gpu/build_and_test.sh with LORASTREAM_GPU_STEPS=parity):
#   tools/parity/run_all.sh OUT_DIR
# Writes OUT_DIR/parity/{parity.md,parity.json} (logits, loss, LoRA gradients, adapter format
# against transformers + peft, 4 model types, f32 and bf16) and OUT_DIR/speed/{speed.md,
# speed.json} (a resident training step against transformers + peft). Uses the build in
# $LORASTREAM_BUILD_DIR (default: build/). Exit status non-zero when a f32 target is missed.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${1:?usage: run_all.sh OUT_DIR}"
BUILD="${LORASTREAM_BUILD_DIR:-$ROOT/build}"
DEVICE="${LORASTREAM_PARITY_DEVICE:-cuda:0}"
mkdir -p "$OUT/parity" "$OUT/speed"
status=0
python3 "$ROOT/tools/parity/parity.py" --worker "$BUILD/bin/lorastream-worker" \
  --out "$OUT/parity" --device "$DEVICE" 2>&1 | tee "$OUT/parity/parity.log"
[[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
python3 "$ROOT/tools/parity/speed.py" --bin "$BUILD/bin" --out "$OUT/speed" \
  --device "$DEVICE" ${LORASTREAM_SPEED_MODEL:+--model-dir "$LORASTREAM_SPEED_MODEL"} 2>&1 \
  | tee "$OUT/speed/speed.log"
[[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
# The checkpoint of the speed run is large (~9 GB): drop it unless asked to keep it.
[[ -n "${LORASTREAM_KEEP_SPEED_MODEL:-}" ]] || rm -rf "$OUT/speed/llama-3-8b-16l"
exit $status
