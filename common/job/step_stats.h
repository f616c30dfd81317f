// Per-step training statistics, as the worker measures them and the coordinator stores them.
// Torch-free; serialised with cereal inside the envelope and as JSON lines.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

namespace lorastream {

struct StepStats {
  int64_t step = 0;  // 1-based optimizer step
  int64_t total_steps = 0;
  double loss = 0.0;
  double learning_rate = 0.0;
  double grad_norm = 0.0;
  int64_t tokens = 0;  // tokens processed in this step (all micro-batches)
  double step_seconds = 0.0;
  double tokens_per_second = 0.0;
  uint64_t h2d_bytes = 0;         // bytes copied host->device for base weights this step
  double h2d_busy_seconds = 0.0;  // time the copy stream was busy
  double stall_seconds = 0.0;     // time compute waited for a copy (measured with events)
  int64_t copies = 0;             // block copies made
  int64_t copies_saved = 0;       // block uses served by a block still in a slot
  uint64_t peak_device_bytes = 0;
  // The evaluation run after this step (job key [eval]); NaN when there was none.
  double eval_loss = std::numeric_limits<double>::quiet_NaN();  // token-weighted mean
  int64_t eval_tokens = 0;                                      // target tokens evaluated

  bool has_eval() const { return !std::isnan(eval_loss); }

  template <class Archive>
  void serialize(Archive& ar) {
    ar(step, total_steps, loss, learning_rate, grad_norm, tokens, step_seconds, tokens_per_second,
       h2d_bytes, h2d_busy_seconds, stall_seconds, copies, copies_saved, peak_device_bytes,
       eval_loss, eval_tokens);
  }
};

}  // namespace lorastream
