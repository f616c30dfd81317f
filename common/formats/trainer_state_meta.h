// The metadata of a checkpoint's trainer_state.safetensors (worker/train/train_state.h writes it):
// "format" = "lorastream-trainer-state", "version" = "1", "step", "samples_seen", "seed",
// "fingerprint" (the job settings a resume must not change) and, optionally, "eval_loss"
// ("nan" or absent: no evaluation at that step). Torch-free, so that the coordinator can read
// it and the parser is fuzzed (fuzz/fuzz_checkpoint.cc).
#pragma once

#include <cstdint>
#include <limits>
#include <map>
#include <string>

namespace lorastream {

struct TrainerStateMeta {
  int64_t step = 0;
  int64_t samples_seen = 0;
  uint64_t seed = 0;
  std::string fingerprint;
  double eval_loss = std::numeric_limits<double>::quiet_NaN();
};

std::map<std::string, std::string> TrainerStateMetadata(const TrainerStateMeta& meta);

// Throws Error(kCorrupt) naming `source` and the key: missing keys, another format or
// version, numbers that are not plain decimal integers in range (step and samples_seen
// >= 0), an eval_loss that is neither "nan" nor a finite number >= 0.
TrainerStateMeta ParseTrainerStateMetadata(const std::map<std::string, std::string>& metadata,
                                           const std::string& source);

}  // namespace lorastream
