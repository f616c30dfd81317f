// The decoder-only LLM family (llama, mistral, qwen2, qwen3: worker/model/model.h) as a family
// of the one trainer (worker/train/family.h). A job's part: its token data and sampler, its peft
// adapter (worker/model/lora.h), its micro-batches' inputs made ahead of the step, dropout
// seeds, evaluation. The group's part: the base (a store or a checkpoint folder), the provider
// (TrainOptions::make_provider: resident or streamed), the LM head, the model and its runners
// (a group of one through its job's MicroBatchRunner, CUDA graphs included; several through
// one GroupMicroBatchRunner: each block acquired once per pass and its base projections run
// once over the rows of every job).
#pragma once

#include <functional>
#include <memory>

#include "common/job/job_spec.h"
#include "worker/train/family.h"
#include "worker/train/trainer.h"

namespace lorastream::worker::llm {

// Whether `spec` is an LLM job (model.store or model.checkpoint, no family section).
bool Accepts(const JobSpec& spec);

std::unique_ptr<FamilyGroup> MakeGroup(const JobSpec& first, const TrainOptions& options,
                                       std::function<bool()> all_stop);

}  // namespace lorastream::worker::llm
