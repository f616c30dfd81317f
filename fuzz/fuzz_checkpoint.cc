// libFuzzer target for what a resume reads from a checkpoint folder before trusting it: the
// checkpoint manifest (JSON) and the trainer state (a safetensors header whose metadata is
// parsed by ParseTrainerStateMetadata). The first byte picks which; every input either parses
// or throws Error(kCorrupt). What parses must round-trip through its writer unchanged.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "common/base/error.h"
#include "common/formats/checkpoint_manifest.h"
#include "common/formats/safetensors.h"
#include "common/formats/trainer_state_meta.h"

using namespace lorastream;

namespace {

void CheckManifest(const std::string& text) {
  const CheckpointManifest m = ParseCheckpointManifest(text, "fuzz");
  const CheckpointManifest back = ParseCheckpointManifest(CheckpointManifestJson(m), "fuzz");
  if (back.files.size() != m.files.size()) std::abort();
  for (size_t i = 0; i < m.files.size(); ++i)
    if (back.files[i].name != m.files[i].name || back.files[i].bytes != m.files[i].bytes ||
        back.files[i].sha256 != m.files[i].sha256)
      std::abort();
}

void CheckTrainerState(const uint8_t* data, size_t size) {
  const SafetensorsHeader h = ParseSafetensorsHeader(data, size, "fuzz");
  const TrainerStateMeta m = ParseTrainerStateMetadata(h.metadata, "fuzz");
  if (m.step < 0 || m.samples_seen < 0) std::abort();
  if (!std::isnan(m.eval_loss) && !(std::isfinite(m.eval_loss) && m.eval_loss >= 0)) std::abort();
  const TrainerStateMeta back = ParseTrainerStateMetadata(TrainerStateMetadata(m), "fuzz");
  if (back.step != m.step || back.samples_seen != m.samples_seen || back.seed != m.seed ||
      back.fingerprint != m.fingerprint ||
      (std::isnan(m.eval_loss) ? !std::isnan(back.eval_loss) : back.eval_loss != m.eval_loss))
    std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  try {
    if (data[0] & 1)
      CheckTrainerState(data + 1, size - 1);
    else
      CheckManifest(std::string(reinterpret_cast<const char*>(data + 1), size - 1));
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kCorrupt) std::abort();
  }
  return 0;
}
