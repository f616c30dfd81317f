// StepStats as JSON: the one mapping of its fields to names, shared by the trainer's
// stats.jsonl, the benchmark's output and the `lorastream stats`/`--json` exports.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "common/job/step_stats.h"

namespace lorastream {

// eval_loss / eval_tokens appear only on steps that ran an evaluation.
nlohmann::json StepStatsToJson(const StepStats& stats);
// One line of JSON (no newline): a stats.jsonl record.
std::string StepStatsJson(const StepStats& stats);

// Drops the records of steps after `step` from the stats file at `path` (absent or not a
// regular file: nothing to do), so that a run resuming from a checkpoint at `step` appends each
// later step once rather than after the records an interrupted run already wrote. Rewritten under a
// temporary name and renamed; throws Error(kIo) naming the file.
void DropStatsAfter(const std::string& path, int64_t step);

}  // namespace lorastream
