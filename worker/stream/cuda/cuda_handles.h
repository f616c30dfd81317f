// Move-only RAII handles for the CUDA resources of the streaming engine: events, a stream,
// a host-range registration and a pinned buffer. Destructors never throw: a failure there is
// logged and cleared. Only worker/*/cuda files include this (it includes the CUDA runtime).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include <cuda_runtime_api.h>

#include "worker/stream/host_registrar.h"

namespace lorastream::worker {

// Throws Error naming `what` when `status` is not cudaSuccess (kResource for out-of-memory
// conditions, kInternal otherwise); clears the error.
void CudaCheck(cudaError_t status, const char* what);

class CudaEvent {
 public:
  explicit CudaEvent(bool timing = false);
  ~CudaEvent();
  CudaEvent(CudaEvent&& other) noexcept : event_(other.event_) { other.event_ = nullptr; }
  CudaEvent& operator=(CudaEvent&& other) noexcept;
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

// A non-blocking stream: it never synchronises implicitly with the legacy default stream,
// which LibTorch's compute usually runs on; a blocking copy stream would serialise with it.
class CudaStream {
 public:
  CudaStream();
  ~CudaStream();
  CudaStream(CudaStream&& other) noexcept : stream_(other.stream_) { other.stream_ = nullptr; }
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

// Page-locks an existing host range for the GPU's DMA engine. The store's segments are
// mapped PROT_READ, which cudaHostRegister accepts only with cudaHostRegisterReadOnly; the
// pages are populated first (registration of an unpopulated mapping spends half its time
// faulting them in).
class HostRegistration {
 public:
  HostRegistration() = default;
  // Returns false (and leaves *this empty, the CUDA error cleared, `error` set) when the range
  // cannot be registered, e.g. under a memlock limit. A range some other owner registered
  // already counts as registered (but is not unregistered by this handle).
  bool Register(const void* ptr, size_t bytes, std::string* error);
  ~HostRegistration();
  HostRegistration(HostRegistration&& other) noexcept;
  HostRegistration(const HostRegistration&) = delete;
  HostRegistration& operator=(const HostRegistration&) = delete;

 private:
  void* ptr_ = nullptr;  // non-null: this handle unregisters it
};

// HostRegistrar (worker/stream/host_registrar.h) through HostRegistration: what the CUDA backend's
// CopySources registers with.
class CudaHostRegistrar : public HostRegistrar {
 public:
  std::unique_ptr<RegisteredRange> Register(const void* ptr, uint64_t bytes,
                                            std::string* error) override;
};

// Reads one byte of every page of [ptr, ptr + bytes) (or asks the kernel to populate it).
void PrefaultReadOnly(const void* ptr, size_t bytes);

// cudaHostAlloc'd memory of exactly `bytes`.
class PinnedBuffer {
 public:
  explicit PinnedBuffer(size_t bytes);
  ~PinnedBuffer();
  PinnedBuffer(PinnedBuffer&& other) noexcept : ptr_(other.ptr_), bytes_(other.bytes_) {
    other.ptr_ = nullptr;
  }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  void* data() const { return ptr_; }
  size_t size() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// cudaMalloc'd device memory of exactly `bytes` (the bandwidth probes' targets).
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* get() const { return ptr_; }

 private:
  void* ptr_ = nullptr;
};

}  // namespace lorastream::worker
