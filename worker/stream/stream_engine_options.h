// The streaming engine's options that a job's caller may set (worker/stream/stream_engine.h).
// Torch-free.
#pragma once

#include <cstdint>

namespace lorastream::worker {

struct StreamEngineOptions {
  bool debug_poison = false;        // see StreamBackendOptions
  int64_t debug_copy_delay_us = 0;  // see StreamBackendOptions
  bool force_staging = false;       // CUDA: always copy through the pinned staging pool
  bool log_plan = true;             // log the residency and the steady pass plan at start
  // A compressed LM head's vocabulary slice (rows; 0: HeadSliceRows's): tests use small ones.
  int64_t head_slice_rows = 0;
};

}  // namespace lorastream::worker
