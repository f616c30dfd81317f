// StepStats as JSON: the one mapping of its fields to names, shared by the trainer's
// stats.jsonl, the benchmark's output and the `lorastream stats`/`--json` exports.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "common/step_stats.h"

namespace lorastream {

// eval_loss / eval_tokens appear only on steps that ran an evaluation.
nlohmann::json StepStatsToJson(const StepStats& stats);
// One line of JSON (no newline): a stats.jsonl record.
std::string StepStatsJson(const StepStats& stats);

}  // namespace lorastream
