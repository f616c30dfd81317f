// The streaming engine as the trainer's BlockProvider for a job (a TrainOptions::make_provider
// factory): plans the residency from the job's [stream] section and serves the blocks.
//
//   TrainOptions options;
//   options.make_provider = [](const JobSpec& spec, const BaseWeights& base,
//                              const std::string& device, const std::string& dtype) {
//     return MakeStreamProvider(spec, base, device, dtype);
//   };
//
// With a store as the base, blocks stream straight from the store's read-only shared memory.
// With a checkpoint folder as the base, or when the stored dtype differs from the compute
// dtype, the blocks are first packed (converted) once into host buffers this provider owns,
// laid out as a store lays them out.
#pragma once

#include <memory>
#include <string>

#include "worker/block_provider.h"
#include "worker/stream_engine.h"

namespace lorastream {

struct JobSpec;
class BaseWeights;

// device: "cpu" | "cuda" | "cuda:N"; dtype: "f32" | "bf16" (the compute dtype). Refusals
// (kRefused) name the [stream] field at fault; the plan is logged.
std::unique_ptr<BlockProvider> MakeStreamProvider(const JobSpec& spec, const BaseWeights& base,
                                                  const std::string& device,
                                                  const std::string& dtype,
                                                  const StreamEngineOptions& options = {});

}  // namespace lorastream
