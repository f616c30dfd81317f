// libFuzzer target: the .npz reader (zip directory, zip64 fields, deflate, .npy headers) must
// turn every input into arrays whose data matches their shape, or Error(kCorrupt) — never a
// crash, a hang, a huge allocation or another exception type.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "common/base/error.h"
#include "common/formats/npz.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    for (const auto& [name, a] : lorastream::ParseNpz(data, size, "fuzz"))
      if (a.data.size() != static_cast<size_t>(a.numel()) * static_cast<size_t>(a.itemsize))
        std::abort();
  } catch (const lorastream::Error& e) {
    if (e.code() != lorastream::ErrorCode::kCorrupt) std::abort();
  }
  return 0;
}
