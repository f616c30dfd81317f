// Rendering of per-step statistics (torch-free): the streaming part of the worker's progress
// line. (The JSON form is common/job/step_stats_json.h.)
#pragma once

#include <string>

#include "common/job/step_stats.h"
#include "common/job/step_stats_json.h"

namespace lorastream::worker {

// The streaming fields for a progress line, e.g.
// "h2d 8.38 GB (152.1 ms busy, 55.1 GB/s) stall 1.3 ms copies 20 saved 8 peak 31.20 GiB".
std::string FormatStreamStats(const StepStats& stats);

}  // namespace lorastream::worker
