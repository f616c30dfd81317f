#!/usr/bin/env bash
# Mixture-of-experts LoRA training on one GPU, side by side in one run:
#   resident  one job, every block resident and checkpointed (blocks_to_swap = 0)
#   auto      the same job planned within 90% of the free GPU memory (gpu_memory_budget =
#             "auto": the planner may keep blocks' activations, no recompute)
#   streamed  the same job within MOE_BENCH_BUDGET (gpu_memory_budget: the planner's choice);
#             its PCIe floor = H2D bytes per step / the H2D bandwidth its calibration measured
#   group     MOE_BENCH_GROUP such jobs (each its own seed and output) as one group within the
#             same budget (`lorastream-worker train a.toml b.toml ...`): aggregate tokens/s
#             against K x one streamed job's
#   hand      (not by default) the same job with the [stream] keys of MOE_BENCH_HAND, a plan by
#             hand (e.g. "blocks_to_swap = 16; ring_size = 4; taped_blocks = 9"): the planner's
#             choice beside another plan on the same machine; its PCIe floor from the streamed
#             run's measured bandwidth
#   nf4       (not by default: the full model needs a big host) the checkpoint served as an NF4
#             store (`lorastream-store serve --quantize nf4 MOE_BENCH_NF4_ARGS`): its bytes
#             (`lorastream-store ls`) and the PSS of its segments beside the bf16 checkpoint's bytes
#             and the 18 GB target, each block's segment extrapolated to the preset's depth where
#             MOE_BENCH_LAYERS is less; then one such job on the store (`[model] store`) within
#             MOE_BENCH_NF4_BUDGET: its step, plan and peak device memory against that budget.
#             The store is stopped and its segments removed at the end, also on failure
#   peer      transformers + peft on the same checkpoint (tools/gpu/bench_moe_peer.py: bf16,
#             LoRA on the same targets, gradient checkpointing on and off, sdpa and every
#             experts backend that runs; its best configuration is the ratio's denominator)
# The model: random Qwen3-30B-A3B-shaped weights (lorastream-synth --preset qwen3-30b-a3b
# --layers MOE_BENCH_LAYERS --dtype bf16; 128 experts of 3 x 2048 x 768 per block, 8 per
# token), MOE_BENCH_TOKENS tokens of random ids, batch 1, rank 16 (alpha 32) on
# q/k/v/o_proj and every expert's gate/up/down, AdamW (f32 moments, or MOE_BENCH_OPTIM),
# bf16 compute (f32 LoRA weights).
# Each figure: the median per-step time (stats.jsonl's step_seconds; the peer's synchronised
# steps) after MOE_BENCH_WARMUP warm-up steps. Writes OUT/moe/: the job files, the logs, each
# run's stats.jsonl, peer.json and bench_moe.md (tools/gpu/bench_moe_table.py: the table, the
# ratios against the targets and the commands).
#
# Usage: tools/gpu/bench_moe.sh OUT_DIR
#   MOE_BENCH_PRESET (qwen3-30b-a3b)  MOE_BENCH_LAYERS (16: fits resident on an 80 GB card in
#   lorastream and in transformers + peft, and a group of 4 within 24 GiB)
#   MOE_BENCH_TOKENS (2048)  MOE_BENCH_STEPS (8)  MOE_BENCH_WARMUP (3)  MOE_BENCH_BUDGET
#   (24GiB)  MOE_BENCH_GROUP (4; 0 or 1: no group run)  MOE_BENCH_DEVICE (cuda:0)
#   MOE_BENCH_DTYPE (bf16: the checkpoint and the jobs' train.dtype)  MOE_BENCH_RUNS (resident,
#   streamed, group, peer, auto: a comma list of those to run, in its order; also nf4, hand)
#   MOE_BENCH_HAND (the hand run's [stream] keys, "; " between them)  MOE_BENCH_OPTIM (adamw;
#   adamw8bit: every job's optim.type, 8-bit AdamW moments)
#   MOE_BENCH_NF4_BUDGET (16GiB: the nf4 run's gpu_memory_budget)  MOE_BENCH_NF4_ARGS (more
#   options of its `lorastream-store serve`, e.g. "--quantize-head --quantize-embedding")
#   MOE_BENCH_PEER_ARGS (more options of bench_moe_peer.py, e.g. "--compile --deadline 300")  MOE_BENCH_TIMEOUT (600: seconds
#   per run)  MOE_BENCH_PEER_TIMEOUT (MOE_BENCH_TIMEOUT: the peer's, every configuration)
#   MOE_BENCH_WORK (a folder under /dev/shm, removed at the end)  LORASTREAM_BUILD_DIR (build/)
#   MOE_BENCH_PEER_CONFIGS (the peer's configurations to run, a semicolon list of their names,
#   e.g. "sdpa, experts grouped_mm, checkpointed"; default: all)
#   MOE_BENCH_PROFILE (0; 1: the two steps after the warm-up of each run profiled, ours with
#   `lorastream-worker train --profile` into OUT/moe/profile_RUN.json(.md), the peer's with
#   torch.profiler into OUT/moe/profile_peer-CONFIGURATION.md; profiled steps run slower, so a profiled run's
#   medians are no timings: profile in a run of its own)
# On a CPU, with tiny-moe: MOE_BENCH_PRESET=tiny-moe MOE_BENCH_LAYERS=4 MOE_BENCH_TOKENS=64
#   MOE_BENCH_DEVICE=cpu MOE_BENCH_DTYPE=f32 MOE_BENCH_BUDGET=1MiB MOE_BENCH_RUNS=resident,streamed,group
#   (,nf4 with MOE_BENCH_NF4_BUDGET=600MiB). The full model as an NF4 store: MOE_BENCH_LAYERS=48
#   MOE_BENCH_RUNS=nf4 (61 GB of bf16 checkpoint in MOE_BENCH_WORK, then the store in /dev/shm:
#   both fit a host whose /dev/shm holds 125 GB, or put MOE_BENCH_WORK on a disk)
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${1:?usage: bench_moe.sh OUT_DIR}/moe"
BIN="${LORASTREAM_BUILD_DIR:-$ROOT/build}/bin"
PRESET="${MOE_BENCH_PRESET:-qwen3-30b-a3b}"
LAYERS="${MOE_BENCH_LAYERS:-16}"
TOKENS="${MOE_BENCH_TOKENS:-2048}"
STEPS="${MOE_BENCH_STEPS:-8}"
WARMUP="${MOE_BENCH_WARMUP:-3}"
BUDGET="${MOE_BENCH_BUDGET:-24GiB}"
GROUP="${MOE_BENCH_GROUP:-4}"
DEVICE="${MOE_BENCH_DEVICE:-cuda:0}"
DTYPE="${MOE_BENCH_DTYPE:-bf16}"
RUNS="${MOE_BENCH_RUNS:-resident,streamed,group,peer,auto}"
NF4_BUDGET="${MOE_BENCH_NF4_BUDGET:-16GiB}"
TIMEOUT="${MOE_BENCH_TIMEOUT:-600}"
PEER_TIMEOUT="${MOE_BENCH_PEER_TIMEOUT:-$TIMEOUT}"
WORK="${MOE_BENCH_WORK:-/dev/shm/lorastream-moe-bench-$$}"
TARGETS='["q_proj", "k_proj", "v_proj", "o_proj", "experts"]'
OPTIM="${MOE_BENCH_OPTIM:-adamw}"
rm -rf "$OUT"  # this run's figures only
mkdir -p "$OUT" "$WORK"
# shellcheck source=tools/store_bench.sh
source "$ROOT/tools/store_bench.sh"  # wait_for_line, store_listing, store_figures
NF4_NAME="moe-bench-nf4-$$"
NF4_PID=
nf4_store_stop() {  # the nf4 run's store stopped; any segment of it still in /dev/shm removed
  if [ -n "$NF4_PID" ]; then
    kill -TERM "$NF4_PID" 2>/dev/null
    wait "$NF4_PID" 2>/dev/null
    NF4_PID=
  fi
  local left
  left=$(compgen -G "/dev/shm/lorastream.$NF4_NAME.*")
  if [ -n "$left" ]; then
    echo "nf4: the store left $(wc -l <<< "$left") segment(s) in /dev/shm; removing them"
    xargs rm -f <<< "$left"
  fi
}
trap 'nf4_store_stop; rm -rf "$WORK"' EXIT
trap 'exit 130' INT TERM

echo "== synth $PRESET, $LAYERS layers ($DTYPE) in $WORK"
start=$(date +%s%N)
"$BIN/lorastream-synth" --preset "$PRESET" --layers "$LAYERS" --presets-dir "$ROOT/configs/models" \
  --out "$WORK/model" --dtype "$DTYPE" || exit 1
echo "synth: $(( ($(date +%s%N) - start) / 1000000 )) ms"
VOCAB=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['vocab_size'])" "$WORK/model/config.json")
# Random token ids: enough documents for every step of every job (packing cuts TOKENS-chunks).
DOCS=$(( (STEPS * TOKENS) / 1000 + 4 ))
PYTHONPATH="$ROOT/tools/gpu" python3 -c "import sys; from bench_multi_gpu import write_data; \
write_data(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), 1000, seed=7)" \
  "$WORK/data.jsonl" "$VOCAB" "$DOCS" || exit 1

job() {  # NAME PLAN-LINES [SEED] [MODEL-LINE (default: checkpoint = the synthesized one)]
  local model="${4:-}"
  [ -n "$model" ] || model="checkpoint = \"$WORK/model\""
  cat > "$OUT/$1.toml" <<JOB
name = "$1"
[model]
$model
[data]
path = "$WORK/data.jsonl"
seq_len = $TOKENS
[lora]
rank = 16
alpha = 32.0
targets = $TARGETS
[optim]
type = "$OPTIM"
lr = 1e-4
[train]
steps = $STEPS
batch_size = 1
seed = ${3:-1}
checkpoint_every = 0
dtype = "$DTYPE"
output_dir = "$WORK/out-$1"
[stream]
$2
JOB
}

status=0
# shellcheck source=tools/gpu/bench_train.sh
source "$ROOT/tools/gpu/bench_train.sh"
BENCH_PROFILE="${MOE_BENCH_PROFILE:-0}"
train() {  # LABEL JOB-NAMES...: bench_train, then the plan and the last step
  bench_train "$@"
  grep -E "stream plan|step $STEPS/" "$OUT/train_$1.log" | cut -c1-400
}

json_of() {  # OUT-FILE KEY=VALUE...: a JSON object of strings
  python3 -c 'import json, sys
json.dump(dict(a.split("=", 1) for a in sys.argv[2:]), open(sys.argv[1], "w"), indent=1)' "$@"
}
nf4_run() {  # the checkpoint as an NF4 store, its RAM, then one job on it
  echo "== store: $NF4_NAME, nf4 ${MOE_BENCH_NF4_ARGS:-}"
  local ckpt_bytes t0 figures=() published
  ckpt_bytes=$(stat -c %s "$WORK/model"/*.safetensors | awk '{ s += $1 } END { printf "%.0f", s }')
  t0=$(date +%s%N)
  # shellcheck disable=SC2086
  "$BIN/lorastream-store" serve "$WORK/model" --name "$NF4_NAME" --quantize nf4 \
    ${MOE_BENCH_NF4_ARGS:-} > "$OUT/store_nf4.out" 2> "$OUT/store_nf4.log" &
  NF4_PID=$!
  if ! wait_for_line "$OUT/store_nf4.out" '^published' "$NF4_PID" "$TIMEOUT" 2> /dev/null; then
    local why="not published after $TIMEOUT s"
    kill -0 "$NF4_PID" 2>/dev/null || { wait "$NF4_PID"; why="serve exited ($?)"; NF4_PID=; }
    json_of "$OUT/store_nf4.json" checkpoint_bytes="$ckpt_bytes" \
      error="the store failed, $why: $(grep -v -e '^\s*$' -e 'Run with --help' "$OUT/store_nf4.log" \
        | tail -1 | cut -c1-300)"
    echo "nf4: $(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["error"])' \
      "$OUT/store_nf4.json")"
    nf4_store_stop
    status=1
    return
  fi
  published=$(grep '^published' "$OUT/store_nf4.out")
  store_listing "$BIN" "$NF4_NAME" > "$OUT/store_nf4_ls.txt"
  read -ra figures < <(store_figures "$OUT/store_nf4_ls.txt")
  json_of "$OUT/store_nf4.json" checkpoint_bytes="$ckpt_bytes" store_bytes="${figures[0]}" \
    block_bytes="${figures[1]}" pss_bytes="${figures[2]}" processes="${figures[3]}" \
    serve_wall_s="$(( ($(date +%s%N) - t0) / 1000000 ))e-3" published="$published" \
    quantised="$(grep -o 'quantising [0-9]* weights ([0-9.]* GB) to nf4' "$OUT/store_nf4.log" \
      | head -1)" \
    args="${MOE_BENCH_NF4_ARGS:-}"
  echo "nf4: checkpoint $ckpt_bytes bytes; store ${figures[0]} bytes (blocks ${figures[1]})," \
    "PSS ${figures[2]} bytes over ${figures[3]} process(es)"
  job nf4 "gpu_memory_budget = \"$NF4_BUDGET\"" 1 "store = \"$NF4_NAME\""
  train nf4 nf4
  nf4_store_stop
}

IFS=',' read -ra run_list <<< "$RUNS"
for run in "${run_list[@]}"; do
  case "$run" in
    "") ;;
    resident)
      job resident "blocks_to_swap = 0"
      train resident resident ;;
    auto)
      job auto "gpu_memory_budget = \"auto\""
      train auto auto ;;
    streamed)
      job streamed "gpu_memory_budget = \"$BUDGET\""
      train streamed streamed ;;
    hand)
      if [ -z "${MOE_BENCH_HAND:-}" ]; then
        echo "MOE_BENCH_RUNS names hand: set MOE_BENCH_HAND to its [stream] keys"; status=1; continue
      fi
      job hand "${MOE_BENCH_HAND//;/$'\n'}"  # one key a line (TOML takes their leading spaces)
      train hand hand ;;
    group)
      [ "$GROUP" -ge 2 ] || continue
      names=()
      for k in $(seq 1 "$GROUP"); do
        job "group$k" "gpu_memory_budget = \"$BUDGET\"" "$k"
        names+=("group$k")
      done
      train group "${names[@]}" ;;
    nf4)
      nf4_run ;;
    peer)
      if python3 -c "import torch, transformers, peft" 2>/dev/null; then
        echo "== peer: transformers + peft"
        # shellcheck disable=SC2086
        timeout "$PEER_TIMEOUT" python3 "$ROOT/tools/gpu/bench_moe_peer.py" --model "$WORK/model" \
          --data "$WORK/data.jsonl" --tokens "$TOKENS" --steps "$STEPS" --warmup "$WARMUP" \
          --device "$DEVICE" --out "$OUT/peer.json" ${MOE_BENCH_PEER_ARGS:-} \
          ${MOE_BENCH_PEER_CONFIGS:+--configs "$MOE_BENCH_PEER_CONFIGS"} \
          $([ "${MOE_BENCH_PROFILE:-0}" = 1 ] && echo "--profile $OUT/profile_peer") 2>&1 \
          | tee "$OUT/peer.log" | grep -vE "^\s*$" | tail -30
        [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
      else
        echo "== peer: skipped (torch, transformers or peft does not import)"
      fi ;;
    *) echo "MOE_BENCH_RUNS: unknown run $run"; status=1 ;;
  esac
done

# The preset's own depth (what an nf4 store of fewer layers is extrapolated to).
FULL_LAYERS=$(sed -n 's/^num_hidden_layers *= *\([0-9]*\).*/\1/p' \
  "$ROOT/configs/models/$PRESET.toml" 2>/dev/null)
python3 "$ROOT/tools/gpu/bench_moe_table.py" "$OUT" --steps "$STEPS" --warmup "$WARMUP" \
  --preset "$PRESET" --layers "$LAYERS" --tokens "$TOKENS" --budget "$BUDGET" \
  --device "$DEVICE" --dtype "$DTYPE" --nf4-budget "$NF4_BUDGET" --full-layers "${FULL_LAYERS:-0}" \
  --hand "${MOE_BENCH_HAND:-}" --optim "$OPTIM" \
  | tee "$OUT/bench_moe.md" || status=1
exit $status
