#!/usr/bin/env bash
# Qwen-Image LoRA training on one GPU, side by side in one run:
#   resident  one job at QI_BENCH_PIXELS, every block resident and checkpointed
#             (blocks_to_swap = 0)
#   streamed  the same job within QI_BENCH_BUDGET (gpu_memory_budget: the planner's choice);
#             its PCIe floor = the plan's bytes copied per step / the H2D bandwidth its
#             calibration measured
#   auto      the same job with gpu_memory_budget = "auto" (90% of the free GPU memory; the
#             planner's choice)
#   group     one job at QI_BENCH_GROUP_PIXELS alone, then QI_BENCH_GROUP such jobs (each its
#             own seed and output) as one group (`lorastream-worker train a.toml b.toml ...`),
#             both within QI_BENCH_GROUP_BUDGET: the group's image tokens/s against one job's
#   fp8       the checkpoint served as an fp8 store (`lorastream-store serve --quantize fp8`: the
#             blocks' projections in e4m3 with 128x128 block scales, expanded on the GPU) and the
#             same job naming the store within QI_BENCH_FP8_BUDGET
#   peer      diffusers + peft on the same checkpoint (tools/gpu/bench_qwen_image_peer.py: bf16,
#             LoRA on the same targets, gradient checkpointing on and off, each SDPA kernel and
#             diffusers' other attention backends, each configuration within
#             QI_BENCH_PEER_DEADLINE seconds; its fastest checkpointed configuration is the
#             like-with-like denominator)
#   musubi    musubi-tuner's streaming as a peer, both in this run: our job with blocks_to_swap =
#             QI_BENCH_SWAP and ring_size = 2 (no budget: the plan by hand), and diffusers' model
#             + peft with QI_BENCH_SWAP blocks streamed by musubi-tuner's H2D-only offloader
#             (LoRAStreamOffloader, 2 slots, pinned; bench_qwen_image_peer.py --musubi-offloader:
#             its own placement, at even intervals), the rest resident, checkpointed, each SDPA
#             kernel; each row's PCIe floor = its bytes copied per step / the pinned H2D bandwidth
#             the peer measured. Its file (QI_BENCH_MUSUBI) is musubi-tuner's, not ours: without
#             it the run is off by default, and named, it runs ours alone and the table says why
# The model: random Qwen-Image-shaped weights (lorastream-synth --preset qwen-image with
# num_layers = QI_BENCH_LAYERS, --qwen-image-format diffusers: transformer/config.json and the
# weights, which the peer loads with from_pretrained), musubi-tuner-style caches of one image
# (--caches: one latent of the size, QI_BENCH_TEXT_TOKENS caption tokens of 3584 features),
# batch 1, rank 16 (alpha 16) on musubi-tuner's targets (targets = ["default"]), AdamW, the
# flow-matching loss, QI_BENCH_DTYPE compute (f32 LoRA and optimizer).
# Each figure: the median per-step time (stats.jsonl's step_seconds; the peer's synchronised
# steps) after QI_BENCH_WARMUP warm-up steps, the peak device memory (stats.jsonl's
# peak_device_bytes; the peer's max_memory_allocated), beside each row's compute floor (FLOPs
# counted from the shape at QI_BENCH_PEAK_TFLOPS; tools/gpu/bench_qwen_image_table.py says
# how). Writes OUT/qwen_image/: the job files, the logs, each run's stats.jsonl, peer.json and
# bench_qwen_image.md (the table, the ratios against the targets and the command).
#
# Usage: tools/gpu/bench_qwen_image.sh OUT_DIR
#   QI_BENCH_PRESET (qwen-image: a name in configs/models or a .toml path)  QI_BENCH_LAYERS
#   (60: every block)  QI_BENCH_PIXELS (1024x1024: 4096 image tokens)  QI_BENCH_TEXT_TOKENS
#   (256)  QI_BENCH_STEPS (6)  QI_BENCH_WARMUP (2)  QI_BENCH_BUDGET (24GiB)  QI_BENCH_GROUP
#   (4; 0 or 1: no group run)  QI_BENCH_FP8_BUDGET (12GiB: the fp8 run's)  QI_BENCH_GROUP_PIXELS (512x512)  QI_BENCH_GROUP_BUDGET
#   (QI_BENCH_BUDGET)  QI_BENCH_RUNS (resident,streamed,auto,group,peer: a comma list of those
#   to run, in its order; musubi too where QI_BENCH_MUSUBI is a file and the device CUDA)
#   QI_BENCH_SWAP (3/4 of QI_BENCH_LAYERS rounded up, at most QI_BENCH_LAYERS - 1: 45 of 60;
#   1 to QI_BENCH_LAYERS - 1: musubi-tuner streams at most that many)  QI_BENCH_MUSUBI
#   (.musubi/custom_offloading_utils.py: src/musubi_tuner/modules/custom_offloading_utils.py of
#   a musubi-tuner checkout)  QI_BENCH_DEVICE (cuda:0)  QI_BENCH_DTYPE (bf16: the checkpoint and
#   the jobs' train.dtype)  QI_BENCH_PEER_DEADLINE (60: seconds per peer configuration)
#   QI_BENCH_PEER_ARGS (more options of bench_qwen_image_peer.py, e.g. "--compile")
#   QI_BENCH_PEER_CONFIGS (its configurations to run, by name, ";" between them, e.g.
#   "checkpointed, SDPA;no checkpointing, SDPA"; default: every one)
#   QI_BENCH_PROFILE (0; 1: the two steps after the warm-up of each run profiled: ours into
#   OUT/qwen_image/profile_RUN.json(.md), the peer's into profile_peer-CONFIGURATION.md; profiled steps run slower, so a profiled run's
#   medians are no timings: profile in a run of its own)
#   QI_BENCH_PEAK_TFLOPS (790: the compute floors' rate)  QI_BENCH_TIMEOUT (600: seconds per
#   run)  QI_BENCH_PEER_TIMEOUT (QI_BENCH_TIMEOUT: the peer's, every configuration, and the
#   musubi peer's; what ran before it stays in peer.json, peer_musubi.json)  QI_BENCH_WORK (a folder under /dev/shm, removed at the end)
#   LORASTREAM_BUILD_DIR (build/)
# On a CPU, with qwen-image-tiny: QI_BENCH_PRESET=qwen-image-tiny QI_BENCH_LAYERS=4
#   QI_BENCH_DEVICE=cpu QI_BENCH_DTYPE=f32 QI_BENCH_PIXELS=64x64 QI_BENCH_TEXT_TOKENS=8
#   QI_BENCH_GROUP_PIXELS=32x32 QI_BENCH_BUDGET=1600KiB
#   QI_BENCH_GROUP_BUDGET=8MiB QI_BENCH_FP8_BUDGET=1600KiB QI_BENCH_STEPS=4 QI_BENCH_WARMUP=1
#   (the peer runs when torch, peft and diffusers import, else the table says it was skipped)
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${1:?usage: bench_qwen_image.sh OUT_DIR}/qwen_image"
BIN="${LORASTREAM_BUILD_DIR:-$ROOT/build}/bin"
PRESET="${QI_BENCH_PRESET:-qwen-image}"
LAYERS="${QI_BENCH_LAYERS:-60}"
[[ "$LAYERS" =~ ^[1-9][0-9]*$ ]] || { echo "QI_BENCH_LAYERS: not a block count: $LAYERS"; exit 2; }
PIXELS="${QI_BENCH_PIXELS:-1024x1024}"
TEXT="${QI_BENCH_TEXT_TOKENS:-256}"
STEPS="${QI_BENCH_STEPS:-6}"
WARMUP="${QI_BENCH_WARMUP:-2}"
BUDGET="${QI_BENCH_BUDGET:-24GiB}"
GROUP="${QI_BENCH_GROUP:-4}"
GROUP_PIXELS="${QI_BENCH_GROUP_PIXELS:-512x512}"
GROUP_BUDGET="${QI_BENCH_GROUP_BUDGET:-$BUDGET}"
FP8_BUDGET="${QI_BENCH_FP8_BUDGET:-12GiB}"
SWAP_DEFAULT=$(( (LAYERS * 3 + 3) / 4 ))  # 3/4 rounded up, at most LAYERS - 1 (musubi-tuner's)
[ "$SWAP_DEFAULT" -lt "$LAYERS" ] || SWAP_DEFAULT=$(( LAYERS - 1 ))
SWAP="${QI_BENCH_SWAP:-$SWAP_DEFAULT}"
MUSUBI="${QI_BENCH_MUSUBI:-$ROOT/.musubi/custom_offloading_utils.py}"
MUSUBI_RING=2  # the target's: musubi-tuner's default --block_swap_ring_size
DEVICE="${QI_BENCH_DEVICE:-cuda:0}"
DEFAULT_RUNS=resident,streamed,auto,group,peer
# musubi-tuner's offloader runs on CUDA only, and streams at least one block of two.
[ -f "$MUSUBI" ] && [[ "$DEVICE" == cuda* ]] && [ "$LAYERS" -ge 2 ] && DEFAULT_RUNS+=",musubi"
RUNS="${QI_BENCH_RUNS:-$DEFAULT_RUNS}"
DTYPE="${QI_BENCH_DTYPE:-bf16}"
PEER_DEADLINE="${QI_BENCH_PEER_DEADLINE:-60}"
PEAK_TFLOPS="${QI_BENCH_PEAK_TFLOPS:-790}"
TIMEOUT="${QI_BENCH_TIMEOUT:-600}"
PEER_TIMEOUT="${QI_BENCH_PEER_TIMEOUT:-$TIMEOUT}"
WORK="${QI_BENCH_WORK:-/dev/shm/lorastream-qi-bench-$$}"
PRESET_FILE="$PRESET"
[ -f "$PRESET_FILE" ] || PRESET_FILE="$ROOT/configs/models/$PRESET.toml"
[ -f "$PRESET_FILE" ] || { echo "QI_BENCH_PRESET: no $PRESET_FILE"; exit 2; }
rm -rf "$OUT"  # this run's figures only
mkdir -p "$OUT" "$WORK"
STORE_PID=""
trap '[ -n "$STORE_PID" ] && kill "$STORE_PID" 2>/dev/null && wait "$STORE_PID"; rm -rf "$WORK"' EXIT
COMMAND="QI_BENCH_PRESET=$PRESET QI_BENCH_LAYERS=$LAYERS QI_BENCH_PIXELS=$PIXELS \
QI_BENCH_TEXT_TOKENS=$TEXT QI_BENCH_STEPS=$STEPS QI_BENCH_WARMUP=$WARMUP QI_BENCH_BUDGET=$BUDGET \
QI_BENCH_GROUP=$GROUP QI_BENCH_GROUP_PIXELS=$GROUP_PIXELS QI_BENCH_GROUP_BUDGET=$GROUP_BUDGET \
QI_BENCH_FP8_BUDGET=$FP8_BUDGET \
QI_BENCH_RUNS=$RUNS${QI_BENCH_SWAP:+ QI_BENCH_SWAP=$SWAP} QI_BENCH_DEVICE=$DEVICE QI_BENCH_DTYPE=$DTYPE \
QI_BENCH_PEER_DEADLINE=$PEER_DEADLINE${QI_BENCH_PEER_ARGS:+ QI_BENCH_PEER_ARGS=\"$QI_BENCH_PEER_ARGS\"}${QI_BENCH_PEER_CONFIGS:+ QI_BENCH_PEER_CONFIGS=\"$QI_BENCH_PEER_CONFIGS\"} \
tools/gpu/bench_qwen_image.sh OUT"

synth() {  # LAYERS OUT-DIR CACHE-DIR PIXELS: a checkpoint of LAYERS blocks, one image's caches
  sed "s/^num_layers = .*/num_layers = $1/" "$PRESET_FILE" > "$WORK/preset_$1.toml"
  "$BIN/lorastream-synth" --preset "$WORK/preset_$1.toml" --out "$2" --dtype "$DTYPE" \
    --qwen-image-format diffusers --caches "$3" --flux-cache-size "$4" --flux-text-tokens "$TEXT"
}
echo "== synth $PRESET, $LAYERS blocks ($DTYPE), one $PIXELS image ($TEXT text tokens) in $WORK"
start=$(date +%s%N)
synth "$LAYERS" "$WORK/model" "$WORK/cache" "$PIXELS" || exit 1
echo "synth: $(( ($(date +%s%N) - start) / 1000000 )) ms"
cp "$WORK/model/transformer/config.json" "$OUT/config.json"
if [[ ",$RUNS," == *,group,* ]] && [ "$GROUP" -ge 2 ]; then
  # The caches depend on the text width alone: a one-block checkpoint writes them quickly.
  synth 1 "$WORK/scratch" "$WORK/cache_group" "$GROUP_PIXELS" > /dev/null || exit 1
  rm -rf "$WORK/scratch"
fi

job() {  # NAME CACHE-DIR PLAN-LINES [SEED] [MODEL-LINE: the checkpoint's by default]
  local model="${5:-checkpoint = \"$WORK/model/transformer\"}"
  cat > "$OUT/$1.toml" <<JOB
name = "$1"
[model]
$model
[lora]
rank = 16
alpha = 16.0
targets = ["default"]
[optim]
lr = 1e-4
[train]
steps = $STEPS
batch_size = 1
seed = ${4:-1}
checkpoint_every = 0
dtype = "$DTYPE"
output_dir = "$WORK/out-$1"
[stream]
$3
[qwen_image]
cache_dir = "$2"
JOB
}

status=0
# shellcheck source=tools/gpu/bench_train.sh
source "$ROOT/tools/gpu/bench_train.sh"
# shellcheck source=tools/store_bench.sh
source "$ROOT/tools/store_bench.sh"  # wait_for_line
BENCH_PROFILE="${QI_BENCH_PROFILE:-0}"
train() {  # LABEL JOB-NAMES...: bench_train, then the plan and the last step
  bench_train "$@"
  sed 's/\\x0a/\n/g' "$OUT/train_$1.log" | grep -E "^chosen:" | head -1
  grep -E "step $STEPS/" "$OUT/train_$1.txt" | cut -c1-200
}

peer_imports() {  # torch, peft and diffusers import (else the peers are skipped)
  PYTHONPATH="$ROOT/.diffusers/src" python3 -c "import torch, peft, diffusers" 2>/dev/null
}

IFS=',' read -ra run_list <<< "$RUNS"
for run in "${run_list[@]}"; do
  case "$run" in
    "") ;;
    resident)
      job resident "$WORK/cache" "blocks_to_swap = 0"
      train resident resident ;;
    streamed)
      job streamed "$WORK/cache" "gpu_memory_budget = \"$BUDGET\""
      train streamed streamed ;;
    fp8)
      # The checkpoint served compressed; the job names the store (the worker attaches it).
      store="qi-bench-fp8-$$"
      echo "== serve the checkpoint --quantize fp8 as store $store"
      "$BIN/lorastream-store" serve "$WORK/model/transformer" --name "$store" --quantize fp8 \
        > "$OUT/store_fp8.log" 2>&1 &
      STORE_PID=$!
      if wait_for_line "$OUT/store_fp8.log" '^published' "$STORE_PID" "$TIMEOUT" 2> /dev/null; then
        grep '^published' "$OUT/store_fp8.log"
        job fp8 "$WORK/cache" "gpu_memory_budget = \"$FP8_BUDGET\"" 1 "store = \"$store\""
        train fp8 fp8
      else
        echo "the fp8 store did not publish:"; tail -20 "$OUT/store_fp8.log"; status=1
      fi
      kill "$STORE_PID" 2>/dev/null && wait "$STORE_PID"
      STORE_PID="" ;;
    auto)
      job auto "$WORK/cache" "gpu_memory_budget = \"auto\""
      train auto auto ;;
    group)
      [ "$GROUP" -ge 2 ] || continue
      job one "$WORK/cache_group" "gpu_memory_budget = \"$GROUP_BUDGET\""
      train one one
      names=()
      for k in $(seq 1 "$GROUP"); do
        job "group$k" "$WORK/cache_group" "gpu_memory_budget = \"$GROUP_BUDGET\"" "$k"
        names+=("group$k")
      done
      train group "${names[@]}" ;;
    peer)
      if peer_imports; then
        echo "== peer: diffusers + peft"
        # shellcheck disable=SC2086
        PYTHONPATH="$ROOT/.diffusers/src" timeout "$PEER_TIMEOUT" python3 \
          "$ROOT/tools/gpu/bench_qwen_image_peer.py" --model "$WORK/model/transformer" \
          --pixels "$PIXELS" --text-tokens "$TEXT" --steps "$STEPS" --warmup "$WARMUP" \
          --device "$DEVICE" --deadline "$PEER_DEADLINE" --out "$OUT/peer.json" \
          $([ "${QI_BENCH_PROFILE:-0}" = 1 ] && echo "--profile $OUT/profile_peer") \
          ${QI_BENCH_PEER_CONFIGS:+--configs "$QI_BENCH_PEER_CONFIGS"} \
          ${QI_BENCH_PEER_ARGS:-} 2>&1 | tee "$OUT/peer.log" | grep -vE "^\s*$|step [0-9]+/" | tail -30
        [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
      else
        echo "== peer: skipped (torch, peft or diffusers does not import with" \
             "PYTHONPATH=$ROOT/.diffusers/src)"
        echo "torch, peft or diffusers ($ROOT/.diffusers/src) does not import on this machine" \
          > "$OUT/peer_skipped.txt"
      fi ;;
    musubi)
      if ! [[ "$SWAP" =~ ^[1-9][0-9]*$ ]] || [ "$SWAP" -ge "$LAYERS" ]; then
        echo "QI_BENCH_SWAP=$SWAP: must be 1 to $((LAYERS - 1)) (QI_BENCH_LAYERS=$LAYERS)" |
          tee "$OUT/musubi_skipped.txt"
        status=1
        continue
      fi
      job musubi "$WORK/cache" "blocks_to_swap = $SWAP
ring_size = $MUSUBI_RING"
      train musubi musubi
      if [ ! -f "$MUSUBI" ]; then
        echo "no musubi-tuner offloader at $MUSUBI (QI_BENCH_MUSUBI: a musubi-tuner checkout's" \
             "src/musubi_tuner/modules/custom_offloading_utils.py)" | tee "$OUT/musubi_skipped.txt"
      elif [[ "$DEVICE" != cuda* ]]; then
        echo "musubi-tuner's LoRAStreamOffloader runs on CUDA only (QI_BENCH_DEVICE=$DEVICE)" |
          tee "$OUT/musubi_skipped.txt"
      elif peer_imports; then
        echo "== musubi-tuner LoRAStreamOffloader: $SWAP of $LAYERS blocks streamed, ring" \
             "$MUSUBI_RING (diffusers + peft)"
        # shellcheck disable=SC2046
        PYTHONPATH="$ROOT/.diffusers/src" timeout "$PEER_TIMEOUT" python3 \
          "$ROOT/tools/gpu/bench_qwen_image_peer.py" --model "$WORK/model/transformer" \
          --pixels "$PIXELS" --text-tokens "$TEXT" --steps "$STEPS" --warmup "$WARMUP" \
          --device "$DEVICE" --deadline "$PEER_DEADLINE" --out "$OUT/peer_musubi.json" \
          --musubi-offloader "$MUSUBI" --swap "$SWAP" --ring "$MUSUBI_RING" \
          $([ "${QI_BENCH_PROFILE:-0}" = 1 ] && echo "--profile $OUT/profile_musubi") \
          2>&1 | tee "$OUT/peer_musubi.log" | grep -vE "^\s*$|step [0-9]+/" | tail -30
        [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
      else
        echo "torch, peft or diffusers ($ROOT/.diffusers/src) does not import on this machine" |
          tee "$OUT/musubi_skipped.txt"
      fi ;;
    *) echo "QI_BENCH_RUNS: unknown run $run"; status=1 ;;
  esac
done

python3 "$ROOT/tools/gpu/bench_qwen_image_table.py" "$OUT" --steps "$STEPS" --warmup "$WARMUP" \
  --pixels "$PIXELS" --text-tokens "$TEXT" --group-pixels "$GROUP_PIXELS" --budget "$BUDGET" \
  --group-budget "$GROUP_BUDGET" --fp8-budget "$FP8_BUDGET" --device "$DEVICE" --dtype "$DTYPE" --rank 16 --swap "$SWAP" \
  --peak-tflops "$PEAK_TFLOPS" --command "$COMMAND" | tee "$OUT/bench_qwen_image.md" || status=1
exit $status
