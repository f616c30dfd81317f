// The model families lorastream trains: a job's (common/job/job_kind.h JobFamily), a store's
// (Manifest::model_family), `lorastream up`'s. One enum, compared as such; names only for
// people. Torch-free.
#pragma once

namespace lorastream {

enum class ModelFamily { kLlm, kFlux, kQwenImage };

// As logs and refusals name it (Manifest::family() adds an LLM's model_type): "LLM",
// "FLUX.1", "Qwen-Image".
inline const char* ModelFamilyName(ModelFamily f) {
  switch (f) {
    case ModelFamily::kFlux:
      return "FLUX.1";
    case ModelFamily::kQwenImage:
      return "Qwen-Image";
    case ModelFamily::kLlm:
      break;
  }
  return "LLM";
}

}  // namespace lorastream
