// Where a step's time goes: `lorastream-worker train --profile FILE` records a window of group
// steps with LibTorch's profiler (Kineto: every operator on the host and, on CUDA, every
// kernel, copy and memset on the device) and writes
//   FILE     the Chrome trace (chrome://tracing, Perfetto)
//   FILE.md  the window's wall time, the device's busy time and the kernels (or, on the CPU,
//            the operators) that took it, most first, each with its calls and share
// The window starts at the group's `first`-th step of this process (1-based: earlier steps are
// warm-ups, the allocator's and the kernels' first calls) and spans `steps` steps.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace lorastream::worker {

struct StepProfileOptions {
  std::string path;   // "" = no profile
  int64_t first = 3;  // the first profiled step of this process (1-based)
  int64_t steps = 2;  // how many
};

// Throws an Error naming what is wrong: a window that starts before step 1 or is empty, or a
// FILE (or FILE.md) that cannot be written. Nothing to check when path is "".
void CheckStepProfile(const StepProfileOptions& options);

class StepProfile {
 public:
  // `device`: "cpu" or "cuda[:N]", the activities recorded. Checks the options
  // (CheckStepProfile).
  StepProfile(StepProfileOptions options, const std::string& device);
  ~StepProfile();  // a window still open (training ended inside it) is written as far as it went
  StepProfile(const StepProfile&) = delete;
  StepProfile& operator=(const StepProfile&) = delete;

  // Around each group step; numbering is the profile's own (1, 2, ...).
  void BeforeStep();
  void AfterStep();
  bool written() const { return written_; }

 private:
  void Finish();

  StepProfileOptions options_;
  bool cuda_ = false;
  int64_t step_ = 0;
  bool recording_ = false;
  bool written_ = false;
  std::chrono::steady_clock::time_point window_start_;
};

}  // namespace lorastream::worker
