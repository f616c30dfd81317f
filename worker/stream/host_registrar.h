// Registration (page-locking) of existing host memory for a device's copy engine, behind an
// interface free of CUDA and LibTorch: the CUDA backend registers through CudaHostRegistrar
// (worker/stream/cuda/cuda_handles.h: cudaHostRegister, read-only and portable), and the torch-free
// decisions built on it (worker/stream/copy_sources.h) are tested on the CPU with registrars that
// succeed or fail as the test says.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

namespace lorastream::worker {

// One registered range; destroying it unregisters the range (when this owner registered it).
class RegisteredRange {
 public:
  virtual ~RegisteredRange() = default;
};

class HostRegistrar {
 public:
  virtual ~HostRegistrar() = default;
  // Registers [ptr, ptr + bytes). nullptr with `*error` set (the device's words) when it
  // cannot, e.g. under a memlock limit; a range another owner registered already counts as
  // registered.
  virtual std::unique_ptr<RegisteredRange> Register(const void* ptr, uint64_t bytes,
                                                    std::string* error) = 0;
};

}  // namespace lorastream::worker
