#!/usr/bin/env bash
# How close the compressed bases (fp8, nf4) come to the bf16 one, on a CUDA machine
# (tools/gpu/build_and_test.sh runs it as the step `quant`): synthesises a 16-layer
# llama-3-8b-shaped checkpoint (bf16, ~9 GB; shared with the streaming benchmark under
# $LORASTREAM_BENCH_DIR), writes a learnable data set (each document a random 32-token phrase
# repeated, so a LoRA learns to continue it), and runs `lorastream-worker quant-report`: weight
# SQNR per projection kind and overall, KL(bf16 || format) of the base models' next-token
# distributions on two eval batches, and the eval loss after the same short training run on
# each base. Results: OUT/quant_report.md (the table and the command), quant_report.json,
# quant_report.log.
#
# Usage: tools/gpu/quant_report.sh OUT_DIR
#   LORASTREAM_BUILD_DIR   the build (default build/)
#   LORASTREAM_QREPORT_PRESET, _LAYERS, _DEVICE, _STEPS, _SEQ   the model (llama-3-8b, 16
#     layers), the device (cuda:0), training steps (60) and tokens per sequence (512)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${1:?usage: quant_report.sh OUT_DIR}"
BIN="${LORASTREAM_BUILD_DIR:-$ROOT/build}/bin"
PRESET="${LORASTREAM_QREPORT_PRESET:-llama-3-8b}"
LAYERS="${LORASTREAM_QREPORT_LAYERS:-16}"
DEVICE="${LORASTREAM_QREPORT_DEVICE:-cuda:0}"
STEPS="${LORASTREAM_QREPORT_STEPS:-60}"
SEQ="${LORASTREAM_QREPORT_SEQ:-512}"
WORK="$OUT/quant_report"
mkdir -p "$WORK"
CKPT="${LORASTREAM_BENCH_DIR:-/tmp/lorastream-bench}/$PRESET-$LAYERS"
if [[ ! -f "$CKPT/config.json" ]]; then
  "$BIN/lorastream-synth" --preset "$PRESET" --layers "$LAYERS" --out "$CKPT" \
    --presets-dir "$ROOT/configs/models" --force
fi
python3 - "$WORK/data.jsonl" "$SEQ" <<'PY'
import json, random, sys
path, seq = sys.argv[1], int(sys.argv[2])
rng = random.Random(1)
with open(path, "w") as f:
    for _ in range(240):
        phrase = [rng.randrange(1000, 30000) for _ in range(32)]
        f.write(json.dumps({"input_ids": (phrase * (seq // 32 + 1))[:seq]}) + "\n")
PY
cat > "$WORK/job.toml" <<TOML
name = "quant-report"
[model]
checkpoint = "$CKPT"
[data]
path = "data.jsonl"
seq_len = $SEQ
packing = false
[lora]
rank = 16
alpha = 32
[optim]
lr = 2e-4
warmup_steps = 5
[train]
steps = $STEPS
batch_size = 1
seed = 1
output_dir = "out"
[eval]
split = 0.1
TOML
cmd=("$BIN/lorastream-worker" quant-report "$WORK/job.toml" --device "$DEVICE"
     --out "$OUT/quant_report.json")
set +e
"${cmd[@]}" 2>&1 | tee "$OUT/quant_report.log"
status=${PIPESTATUS[0]}
set -e
{
  echo "# Compressed bases against bf16 ($(date -u +%F), $PRESET, $LAYERS layers, $DEVICE)"
  echo
  echo '```'
  grep -A3 '^quant-report:' "$OUT/quant_report.log" || true
  echo '```'
  echo
  echo "command: tools/gpu/quant_report.sh OUT ($(printf '%q ' "${cmd[@]}"))"
} > "$OUT/quant_report.md"
rm -rf "$WORK/out"
exit "$status"
