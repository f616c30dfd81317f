// Which kind of model a job trains, read from its sections: the one answer every rule that
// holds for one kind only asks (the LLM family's Accepts, the LLM adapters' consumer warnings,
// the LLM-only checks of ValidateJobSpec, the base `lorastream up` serves). A diffusion job
// carries its family's section ([flux], [qwen_image]); every other job trains a language
// model, dense or a mixture of experts. A new diffusion family adds its flag and its value
// here. Torch-free.
#pragma once

#include "common/formats/model_family.h"
#include "common/job/job_spec.h"

namespace lorastream {

// The family of a job with (or without) a [flux] and a [qwen_image] section; [flux] first,
// as ParseJobSpec reads them.
inline ModelFamily JobFamily(bool has_flux_section, bool has_qwen_image_section) {
  if (has_flux_section) return ModelFamily::kFlux;
  return has_qwen_image_section ? ModelFamily::kQwenImage : ModelFamily::kLlm;
}
inline ModelFamily JobFamily(const JobSpec& s) { return JobFamily(s.is_flux, s.is_qwen_image); }

inline bool IsLanguageModelJob(const JobSpec& s) { return JobFamily(s) == ModelFamily::kLlm; }

}  // namespace lorastream
