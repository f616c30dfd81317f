// `lorastream doctor`'s real test of the store's foundation on this GPU: map a small shared-
// memory object read-only (as a worker maps a store), register it with
// cudaHostRegisterReadOnly, copy it to the GPU and back, compare. Run by the hidden
// `lorastream-worker probe-host-register` (CUDA builds only; the definition lives in
// worker/stream/cuda/).
#pragma once

#include <cstddef>
#include <string>

#include <nlohmann/json.hpp>

namespace lorastream::worker {

// {"device", "bytes", "ok", "error" (when !ok), "step" (which call failed)}.
nlohmann::json ProbeHostRegister(int device_index, size_t bytes = 4u << 20);

}  // namespace lorastream::worker
