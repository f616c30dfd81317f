// Which kind of model a job trains, read from its sections: the one answer every rule that
// holds for one kind only asks (the LLM family's Accepts, the LLM adapters' consumer warnings,
// the LLM-only checks of ValidateJobSpec). A diffusion job carries its family's section
// ([flux], [qwen_image]); every other job trains a language model, dense or a mixture of
// experts. A new diffusion family adds its flag here. Torch-free.
#pragma once

#include "common/job_spec.h"

namespace lorastream {

inline bool IsLanguageModelJob(const JobSpec& s) { return !s.is_flux && !s.is_qwen_image; }

}  // namespace lorastream
