# shellcheck shell=bash
# Sourced by the benchmarks that serve a store (bench_store_quant.sh, gpu/bench_moe.sh,
# gpu/bench_flux.sh, gpu/bench_qwen_image.sh).
# wait_for_line FILE PATTERN PID [SECONDS]: polls FILE for a line matching PATTERN while PID
#   lives (SECONDS, 600 unless given); 1 with FILE on stderr when PID exits first or time runs out.
# store_listing BIN NAME: the segment lines and the PSS line of store NAME in
#   `BIN/lorastream-store ls` (its header and the manifest's line left in; other stores left out).
# store_figures LISTING: "STORE BLOCKS PSS PROCESSES" from store_listing's output: the bytes of
#   its block and rest segments (the manifest left out), of its block segments alone, the PSS
#   summed over every process mapping it (the RAM it takes, each page counted once) and how
#   many processes map it.
wait_for_line() {
  local file=$1 pattern=$2 pid=$3 seconds=${4:-600}
  local i
  for ((i = 0; i < seconds * 5; i++)); do
    grep -qs "$pattern" "$file" && return 0
    kill -0 "$pid" 2>/dev/null || { echo "process $pid exited:" >&2; cat "$file" >&2; return 1; }
    sleep 0.2
  done
  echo "no '$pattern' in $file after $seconds s" >&2
  return 1
}

store_listing() {
  "$1/lorastream-store" ls | awk -v n="$2" '
    $0 ~ "^" n ": " { inside = 1; next }
    /^[^ ]/ { inside = 0 }
    inside'
}

store_figures() {
  awk '
    $2 ~ /\.(block\.[0-9]+|rest)$/ { store += $1 }
    $2 ~ /\.block\.[0-9]+$/ { blocks += $1 }
    /in RAM:/ {
      match($0, /\([0-9]+ bytes\)/); pss = substr($0, RSTART + 1, RLENGTH - 8)
      match($0, /over [0-9]+ process/); procs = substr($0, RSTART + 5, RLENGTH - 13)
    }
    END {
      printf "%.0f %.0f %s %s\n", store, blocks, pss == "" ? "-" : pss, procs == "" ? "-" : procs
    }' "$1"
}
