// The cost model's figures (worker/stream_cost.h) measured on the job's own device at the
// job's token count: one block's forward and recompute+backward with the job's LoRA, the LM
// head with its loss, an optimizer step over the adapter, and the Host->Device bandwidth of
// a block copy. A few repetitions of each: a fraction of a second on a GPU. The figures are
// cached per model, device, dtype, LoRA and token count (CalibrationCachePath), so a job
// calibrates once per shape.
#pragma once

#include <string>

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include "worker/stream_cost.h"

namespace lorastream {
struct JobSpec;
}  // namespace lorastream

namespace lorastream::worker {

class BaseWeights;

// The cache key: model (name and shape), device, dtype, rank, targets and tokens.
std::string CalibrationKey(const JobSpec& spec, const BaseWeights& base, const c10::Device& device,
                           c10::ScalarType dtype);

// Measures the figures (no cache).
StepCosts MeasureStepCosts(const JobSpec& spec, const BaseWeights& base, const c10::Device& device,
                           c10::ScalarType dtype);

// From the cache when there, else measured and cached; logs which.
StepCosts CalibratedStepCosts(const JobSpec& spec, const BaseWeights& base,
                              const c10::Device& device, c10::ScalarType dtype);

}  // namespace lorastream::worker
