#!/usr/bin/env bash
# The 8-bit AdamW step on CUDA, its kernel (worker/train/cuda/adamw8bit_kernel.cu) beside its
# ATen path (LORASTREAM_ADAMW8BIT_KERNEL=0) and beside f32 AdamW: one tiny-qwen3 job (f32, rank
# 63 on every projection: padded blocks and f32 moments beside 8-bit ones, lr 1e-3, weight decay
# 0.01, 20 steps) trained three times; prints how far apart the adapters end (largest element,
# and the norm of the difference) and the first and last losses of each.
# Usage: tools/gpu/adamw8bit_check.sh OUT_DIR   (LORASTREAM_BUILD_DIR: build/; DEVICE: cuda:0)
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
W="${1:?usage: adamw8bit_check.sh OUT_DIR}/adamw8bit"
BIN="${LORASTREAM_BUILD_DIR:-$ROOT/build}/bin"
rm -rf "$W" && mkdir -p "$W"
"$BIN/lorastream-synth" --preset tiny-qwen3 --presets-dir "$ROOT/configs/models" --out "$W/m" \
  --dtype f32 > /dev/null || exit 1
PYTHONPATH="$ROOT/tools/gpu" python3 -c \
  "import sys; from bench_multi_gpu import write_data; write_data(sys.argv[1], 320, 40, 200)" \
  "$W/d.jsonl" || exit 1
status=0
for run in kernel aten f32; do
  opt=adamw8bit; [ "$run" = f32 ] && opt=adamw
  cat > "$W/$run.toml" <<JOB
name = "$run"
[model]
checkpoint = "$W/m"
[data]
path = "$W/d.jsonl"
seq_len = 64
[lora]
rank = 63
alpha = 63.0
targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
[optim]
type = "$opt"
lr = 1e-3
weight_decay = 0.01
[train]
steps = 20
batch_size = 2
seed = 3
dtype = "f32"
output_dir = "$W/out-$run"
[stream]
blocks_to_swap = 0
JOB
  kernel=1; [ "$run" = aten ] && kernel=0
  if ! LORASTREAM_ADAMW8BIT_KERNEL=$kernel "$BIN/lorastream-worker" train "$W/$run.toml" \
      --device "${DEVICE:-cuda:0}" > "$W/$run.log" 2>&1; then
    echo "$run failed:"; tail -5 "$W/$run.log"; status=1
  fi
done
[ $status = 0 ] || exit $status
python3 - "$W" <<'PY'
import json, sys
from safetensors.torch import load_file
w = sys.argv[1]
a = {r: load_file(f"{w}/out-{r}/adapter_model.safetensors") for r in ("kernel", "aten", "f32")}
def largest(x, y): return max(float((x[k] - y[k]).abs().max()) for k in x)
def norm(x, y): return sum(float(((x[k] - y[k]) ** 2).sum()) for k in x) ** 0.5
for p, q in (("kernel", "aten"), ("kernel", "f32"), ("aten", "f32")):
    print(f"{p} vs {q}: largest {largest(a[p], a[q]):.3e}, norm {norm(a[p], a[q]):.3e}")
for r in ("kernel", "aten", "f32"):
    losses = [json.loads(line)["loss"] for line in open(f"{w}/out-{r}/stats.jsonl")]
    print(r, "losses", " ".join(f"{x:.5f}" for x in losses[:3]), "...",
          " ".join(f"{x:.5f}" for x in losses[-3:]))
PY
