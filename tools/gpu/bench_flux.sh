#!/usr/bin/env bash
# FLUX.1 LoRA training on one GPU: the resident step, the step streamed within a memory budget
# (the planner's choice), the chosen plan's PCIe floor (bytes copied per step / measured
# bandwidth) and its predicted step, a job group of K such jobs streamed within the same
# budget (its step against K x one job's, and its bytes copied per step), with diffusers +
# peft as the peer when its source is there. Random FLUX.1-dev-shaped weights (lorastream-synth --preset flux1-dev, all 19 + 38
# blocks), one cached 1024x1024 image (4096 image tokens) with 512 T5 tokens, rank 16 on
# every linear layer of the blocks, batch 1, bf16. With FLUX_BENCH_QUANTIZE=fp8 (or nf4) the
# same two runs again on a store of the checkpoint served with `--quantize` (its block linears
# compressed, copied so and expanded on the GPU at each use), each with its plan's prediction.
# Writes OUT/flux/: the plans, the training logs, each job's stats.jsonl (stats_NAME.jsonl) and
# bench_flux.md (a markdown table of the figures and their ratios).
#
# Usage: tools/gpu/bench_flux.sh OUT_DIR
#   FLUX_BENCH_PRESET (flux1-dev)  FLUX_BENCH_DEVICE (cuda)  FLUX_BENCH_DTYPE (bf16)
#   FLUX_BENCH_PIXELS (1024x1024)  FLUX_BENCH_TEXT_TOKENS (512)  FLUX_BENCH_STEPS (6; the
#   first two are warm-up)  FLUX_BENCH_BUDGET (8GiB)  FLUX_BENCH_WORK (a folder under
#   /dev/shm, removed at the end)  FLUX_BENCH_GROUP (2: the jobs of the group row; 0 or 1:
#   no group row)  FLUX_BENCH_GROUP_BUDGET (FLUX_BENCH_BUDGET)  FLUX_BENCH_PEER (1: diffusers +
#   peft when $ROOT/.diffusers/src imports; 0: skip)  FLUX_BENCH_QUANTIZE (none; fp8 | nf4:
#   also the runs on a compressed store)  LORASTREAM_BUILD_DIR (build/)
#   FLUX_BENCH_PROFILE (0; 1: steps 3 and 4 of each single-job run profiled with
#   `lorastream-worker train --profile` into OUT/flux/profile_RUN.json(.md), the peer's with
#   torch.profiler into OUT/flux/profile_peer-CONFIGURATION.md; profiled steps run slower, so a profiled run's
#   medians are no timings: profile in a run of its own)
# On a CPU, with flux-tiny: FLUX_BENCH_PRESET=flux-tiny FLUX_BENCH_DEVICE=cpu
#   FLUX_BENCH_DTYPE=f32 FLUX_BENCH_PIXELS=64x64 FLUX_BENCH_TEXT_TOKENS=8 FLUX_BENCH_BUDGET=4MiB
#   (with FLUX_BENCH_QUANTIZE=fp8: FLUX_BENCH_BUDGET=5MiB, for its expansion scratch)
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# shellcheck source=tools/store_bench.sh
source "$ROOT/tools/store_bench.sh"  # wait_for_line
OUT="${1:?usage: bench_flux.sh OUT_DIR}/flux"
BIN="${LORASTREAM_BUILD_DIR:-$ROOT/build}/bin"
PRESET="${FLUX_BENCH_PRESET:-flux1-dev}"
DEVICE="${FLUX_BENCH_DEVICE:-cuda}"
DTYPE="${FLUX_BENCH_DTYPE:-bf16}"
PIXELS="${FLUX_BENCH_PIXELS:-1024x1024}"
TEXT="${FLUX_BENCH_TEXT_TOKENS:-512}"
STEPS="${FLUX_BENCH_STEPS:-6}"
BUDGET="${FLUX_BENCH_BUDGET:-8GiB}"
GROUP="${FLUX_BENCH_GROUP:-2}"
GROUP_BUDGET="${FLUX_BENCH_GROUP_BUDGET:-$BUDGET}"
PEER="${FLUX_BENCH_PEER:-1}"
QUANTIZE="${FLUX_BENCH_QUANTIZE:-none}"
WORK="${FLUX_BENCH_WORK:-/dev/shm/lorastream-flux-bench-$$}"
case "$QUANTIZE" in none|fp8|nf4) ;; *) echo "FLUX_BENCH_QUANTIZE must be none, fp8 or nf4"; exit 2 ;; esac
mkdir -p "$OUT" "$WORK"
rm -f "$OUT"/stats_*.jsonl  # this run's figures only
STORE_PID=""
cleanup() {
  if [ -n "$STORE_PID" ]; then kill -TERM "$STORE_PID" 2>/dev/null; wait "$STORE_PID" 2>/dev/null; fi
  rm -rf "$WORK"
}
trap cleanup EXIT

echo "== synth $PRESET ($DTYPE) and one $PIXELS image's caches ($TEXT text tokens) in $WORK"
"$BIN/lorastream-synth" --preset "$PRESET" --presets-dir "$ROOT/configs/models" \
  --out "$WORK/model" --dtype "$DTYPE" \
  --flux-caches "$WORK/cache" --flux-cache-size "$PIXELS" --flux-text-tokens "$TEXT" || exit 1

job() {  # NAME BASE-LINE PLAN-LINES
  cat > "$WORK/$1.toml" <<JOB
name = "$1"
[flux]
$2
cache_dir = "cache"
output_dir = "out-$1"
steps = $STEPS
rank = 16
learning_rate = 1e-5
dtype = "$DTYPE"
$3
JOB
}
CHECKPOINT='checkpoint = "model/flux1.safetensors"'
job resident "$CHECKPOINT" "blocks_to_swap = 0"
job streamed "$CHECKPOINT" "gpu_memory_budget = \"$BUDGET\""
RUNS="resident streamed"

status=0
if [ "$QUANTIZE" != none ]; then
  # The checkpoint served compressed; its jobs name the store (the worker attaches it).
  STORE="flux-bench-$QUANTIZE-$$"
  echo "== serve $PRESET --quantize $QUANTIZE as store $STORE"
  "$BIN/lorastream-store" serve "$WORK/model/flux1.safetensors" --name "$STORE" \
    --quantize "$QUANTIZE" > "$OUT/store_$QUANTIZE.log" 2>&1 &
  STORE_PID=$!
  if wait_for_line "$OUT/store_$QUANTIZE.log" '^published' "$STORE_PID" 1200 2> /dev/null; then
    grep '^published' "$OUT/store_$QUANTIZE.log"
    job "resident_$QUANTIZE" "store = \"$STORE\"" "blocks_to_swap = 0"
    job "streamed_$QUANTIZE" "store = \"$STORE\"" "gpu_memory_budget = \"$BUDGET\""
    RUNS="$RUNS resident_$QUANTIZE streamed_$QUANTIZE"
  else
    echo "the $QUANTIZE store did not publish:"; tail -20 "$OUT/store_$QUANTIZE.log"; status=1
  fi
fi

# Each streamed job's plan also predicts its base's resident step (every plan command loads
# the whole model: one per base is enough).
for name in $RUNS; do
  case "$name" in streamed*) ;; *) continue ;; esac
  echo "== plan: $name within $BUDGET"
  "$BIN/lorastream-worker" plan "$WORK/$name.toml" --device "$DEVICE" > "$OUT/plan_$name.txt" \
    2> "$OUT/plan_$name.log" || { tail -20 "$OUT/plan_$name.log"; status=1; }
  cat "$OUT/plan_$name.txt"
done
for name in $RUNS; do
  echo "== train: $name"
  profile=()
  [ "${FLUX_BENCH_PROFILE:-0}" = 1 ] && profile=(--profile "$OUT/profile_$name.json"
    --profile-from 3 --profile-steps 2)
  "$BIN/lorastream-worker" train "$WORK/$name.toml" --device "$DEVICE" --no-resume \
    "${profile[@]}" > "$OUT/train_$name.txt" 2> "$OUT/train_$name.log" || { tail -20 "$OUT/train_$name.log"; status=1; }
  cp "$WORK/out-$name/stats.jsonl" "$OUT/stats_$name.jsonl" 2>/dev/null || true
  grep -E "^step $STEPS/" "$OUT/train_$name.txt"
done

# The group: K jobs of the streamed job's shape (each its own seed and output) as one group
# within the group's budget; each unit is copied once per step for all of them.
if [ "$GROUP" -ge 2 ]; then
  group_jobs=()
  for k in $(seq 1 "$GROUP"); do
    job "group$k" "$CHECKPOINT" "gpu_memory_budget = \"$GROUP_BUDGET\"
seed = $k"
    group_jobs+=("$WORK/group$k.toml")
  done
  echo "== train: a group of $GROUP jobs within $GROUP_BUDGET"
  "$BIN/lorastream-worker" train "${group_jobs[@]}" --device "$DEVICE" --no-resume \
    > "$OUT/train_group.txt" 2> "$OUT/train_group.log" || { tail -20 "$OUT/train_group.log"; status=1; }
  for k in $(seq 1 "$GROUP"); do
    cp "$WORK/out-group$k/stats.jsonl" "$OUT/stats_group$k.jsonl" 2>/dev/null || true
  done
  grep -E "^group1: step $STEPS/" "$OUT/train_group.txt"
fi

if [ "$PEER" = 1 ] && PYTHONPATH="$ROOT/.diffusers/src" python3 -c "import diffusers, peft, torch" 2>/dev/null; then
  echo "== peer: diffusers + peft"
  PYTHONPATH="$ROOT/.diffusers/src" python3 "$ROOT/tools/gpu/bench_flux_peer.py" --preset "$PRESET" \
    --pixels "$PIXELS" --text-tokens "$TEXT" --steps "$STEPS" --device "$DEVICE" \
    --out "$OUT/peer.json" $([ "${FLUX_BENCH_PROFILE:-0}" = 1 ] && echo "--profile $OUT/profile_peer") \
    2>&1 | tail -20 || status=1
else
  echo "== peer: skipped (FLUX_BENCH_PEER=$PEER, or diffusers/peft/torch do not import with" \
       "PYTHONPATH=$ROOT/.diffusers/src)"
fi

python3 "$ROOT/tools/gpu/bench_flux_table.py" "$OUT" "$STEPS" | tee "$OUT/bench_flux.md" || status=1
exit $status
