#!/usr/bin/env bash
# Qwen-Image's memory estimate against the peak a GPU measures: random Qwen-Image-shaped weights
# with QI_LAYERS blocks (configs/models/qwen-image.toml, its num_layers replaced), one cached
# image of QI_PIXELS with QI_TEXT_TOKENS caption tokens, one job (rank 16 on musubi-tuner's
# targets, batch 1, bf16) planned within QI_BUDGET; prints the plan (`lorastream-worker plan`:
# the estimate term by term), trains QI_STEPS steps and prints the estimated peak of the chosen
# plan next to the largest peak_device_bytes of stats.jsonl. Exits 1 when the measured peak is
# above the estimate.
#
# Usage: tools/gpu/qwen_image_estimate.sh OUT_DIR
#   QI_LAYERS (12)  QI_PIXELS (1024x1024: 4096 image tokens)  QI_TEXT_TOKENS (256)
#   QI_BUDGET (8GiB)  QI_STEPS (4)  QI_DEVICE (cuda:0)  QI_DTYPE (bf16)
#   QI_PRESET (configs/models/qwen-image.toml)  LORASTREAM_BUILD_DIR (build/)
# On a CPU: QI_PRESET=configs/models/qwen-image-tiny.toml QI_PIXELS=64x64 QI_TEXT_TOKENS=8
#   QI_BUDGET=auto QI_DEVICE=cpu QI_DTYPE=f32 (the CPU reports no device peak)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="$(mkdir -p "${1:?usage: qwen_image_estimate.sh OUT_DIR}" && cd "$1" && pwd)/qwen_image"
BIN="${LORASTREAM_BUILD_DIR:-$ROOT/build}/bin"
LAYERS="${QI_LAYERS:-12}"
PIXELS="${QI_PIXELS:-1024x1024}"
TEXT="${QI_TEXT_TOKENS:-256}"
BUDGET="${QI_BUDGET:-8GiB}"
STEPS="${QI_STEPS:-4}"
DEVICE="${QI_DEVICE:-cuda:0}"
DTYPE="${QI_DTYPE:-bf16}"
PRESET="${QI_PRESET:-$ROOT/configs/models/qwen-image.toml}"
rm -rf "$OUT"
mkdir -p "$OUT"
sed "s/^num_layers = .*/num_layers = $LAYERS/" "$PRESET" > "$OUT/preset.toml"
"$BIN/lorastream-synth" --preset "$OUT/preset.toml" --out "$OUT/model" --caches "$OUT/cache" \
  --flux-cache-size "$PIXELS" --flux-text-tokens "$TEXT"
cat > "$OUT/job.toml" <<JOB
name = "qi-estimate"
[model]
checkpoint = "$OUT/model/qwen_image.safetensors"
[lora]
rank = 16
alpha = 16.0
[optim]
lr = 1e-4
[train]
steps = $STEPS
batch_size = 1
dtype = "$DTYPE"
output_dir = "$OUT/out"
[stream]
gpu_memory_budget = "$BUDGET"
[qwen_image]
cache_dir = "$OUT/cache"
JOB
"$BIN/lorastream-worker" plan "$OUT/job.toml" --device "$DEVICE" | tee "$OUT/plan.txt"
"$BIN/lorastream-worker" train "$OUT/job.toml" --device "$DEVICE" > "$OUT/train.log" 2>&1 ||
  { tail -20 "$OUT/train.log"; exit 2; }
estimate=$(sed -n 's/.*peak_gib=\([0-9.]*\).*/\1/p' "$OUT/plan.txt" | tail -1)
measured=$(python3 -c "
import json, sys
peaks = [json.loads(l).get('peak_device_bytes', 0) for l in open('$OUT/out/stats.jsonl') if l.strip()]
print('%.3f' % (max(peaks) / 2**30))")
echo "qwen_image estimate: $estimate GiB estimated, $measured GiB measured (peak_device_bytes)"
python3 -c "import sys; sys.exit(0 if $measured <= $estimate else 1)"
