// libFuzzer target: the safetensors header parser must turn every input into either a header
// or Error(kCorrupt) — never a crash, a hang or another exception type.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "common/base/error.h"
#include "common/formats/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    lorastream::SafetensorsHeader h = lorastream::ParseSafetensorsHeader(data, size, "fuzz");
    // What the parser accepted must be self-consistent: in bounds and sorted.
    const uint64_t data_size = size - h.data_offset;
    uint64_t previous_begin = 0;
    for (const auto& e : h.tensors) {
      if (e.end > data_size || e.begin > e.end || e.begin < previous_begin) std::abort();
      previous_begin = e.begin;
    }
  } catch (const lorastream::Error& e) {
    if (e.code() != lorastream::ErrorCode::kCorrupt) std::abort();
  }
  return 0;
}
