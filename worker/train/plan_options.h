// The options of `lorastream-worker plan` that every family's plan command takes
// (worker/serve/plan_command.h, a family's RunPlan).
#pragma once

#include <string>

namespace lorastream::worker {

struct PlanCommandOptions {
  std::string device = "cpu";  // "cpu" | "cuda" | "cuda:N"
  bool recalibrate = false;    // measure again even when cached figures exist
};

}  // namespace lorastream::worker
