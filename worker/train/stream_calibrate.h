// The cost model's figures (worker/stream/stream_cost.h) measured on the job's own device at the
// job's token count: whole training steps of two models made of the job's block (block 0
// repeated as many times as the model has blocks, and half as many; run as the trainer runs
// a step), whose difference is a block's cost in a step and whose remainder is the step's
// tail; one block's forward and
// recompute+backward alone (their split); the LM head with its loss; and the Host->Device
// bandwidth of a block copy. A few repetitions of each: a few seconds on a GPU. The figures are
// cached per model, device, dtype, LoRA and token count (CalibrationCachePath), so a job
// calibrates once per shape.
#pragma once

#include <string>

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include "worker/stream/stream_cost.h"

namespace lorastream {
struct JobSpec;
}  // namespace lorastream

namespace lorastream::worker {

class BaseWeights;

// The cache key: model (name and shape), device, dtype, rank, targets, tokens and the LM
// head's rows per chunk.
std::string CalibrationKey(const JobSpec& spec, const BaseWeights& base, const c10::Device& device,
                           c10::ScalarType dtype);

// Measures the figures (no cache).
StepCosts MeasureStepCosts(const JobSpec& spec, const BaseWeights& base, const c10::Device& device,
                           c10::ScalarType dtype);

// Bytes per second of one copy of `block_bytes` from page-aligned host memory to `device`:
// pinned cudaMemcpyAsync on a GPU, memcpy into a slot on the CPU.
double MeasureH2DBandwidth(uint64_t block_bytes, const c10::Device& device);

// From the cache when there, else measured and cached; logs which.
StepCosts CalibratedStepCosts(const JobSpec& spec, const BaseWeights& base,
                              const c10::Device& device, c10::ScalarType dtype);

}  // namespace lorastream::worker
