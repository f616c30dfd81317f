// Rendering of per-step statistics (torch-free): the JSON line the job's stats file gets and
// the streaming part of the worker's progress line.
#pragma once

#include <string>

#include "common/step_stats.h"

namespace lorastream {

// One JSON object on one line (no trailing newline), every StepStats field by its name.
std::string StepStatsJson(const StepStats& stats);

// The streaming fields for a progress line, e.g.
// "h2d 8.38 GB (152.1 ms busy, 55.1 GB/s) stall 1.3 ms copies 20 saved 8 peak 31.20 GiB".
std::string FormatStreamStats(const StepStats& stats);

}  // namespace lorastream
