# shellcheck shell=bash
# Sourced by the GPU benchmarks (bench_moe.sh, bench_qwen_image.sh).
# bench_train LABEL JOB-NAMES...: one `lorastream-worker train OUT/NAME.toml...` (several: one
# group) within TIMEOUT seconds, its stdout in OUT/train_LABEL.txt and its log in
# OUT/train_LABEL.log; prints its wall time and copies each job's WORK/out-NAME/stats.jsonl to
# OUT/stats_NAME.jsonl. A failure prints the log's tail and sets status=1. Reads BIN, OUT, WORK,
# DEVICE and TIMEOUT; with BENCH_PROFILE=1 the two steps after WARMUP are profiled
# (`--profile`) into OUT/profile_LABEL.json and its .md table.
bench_train() {
  local label=$1
  shift
  local files=() name
  for name in "$@"; do files+=("$OUT/$name.toml"); done
  echo "== train: $label ($*)"
  local t0
  t0=$(date +%s%N)
  local profile=()
  [ "${BENCH_PROFILE:-0}" = 1 ] && profile=(--profile "$OUT/profile_$label.json"
    --profile-from $((${WARMUP:-3} + 1)) --profile-steps 2)
  # shellcheck disable=SC2034 # status: the caller's exit status
  timeout "$TIMEOUT" "$BIN/lorastream-worker" train "${files[@]}" --device "$DEVICE" --no-resume \
    "${profile[@]}" > "$OUT/train_$label.txt" 2> "$OUT/train_$label.log" || { tail -20 "$OUT/train_$label.log"; status=1; }
  echo "$label: $(( ($(date +%s%N) - t0) / 1000000 )) ms wall"
  for name in "$@"; do
    cp "$WORK/out-$name/stats.jsonl" "$OUT/stats_$name.jsonl" 2>/dev/null || true
  done
}
