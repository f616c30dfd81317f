#include "worker/stream/cuda/cuda_handles.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>

#include "common/base/error.h"
#include "common/base/log.h"

namespace lorastream::worker {

namespace {
void WarnIfFailed(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    LS_LOG_WARN("{} failed: {}", what, cudaGetErrorString(status));
    cudaGetLastError();
  }
}
}  // namespace

void CudaCheck(cudaError_t status, const char* what) {
  if (status == cudaSuccess) return;
  cudaGetLastError();  // clear a non-sticky error so that later calls do not see it
  const ErrorCode code =
      status == cudaErrorMemoryAllocation ? ErrorCode::kResource : ErrorCode::kInternal;
  throw Error(code, std::string("CUDA: ") + what + " failed: " + cudaGetErrorName(status) + " (" +
                        cudaGetErrorString(status) + ")");
}

CudaEvent::CudaEvent(bool timing) {
  CudaCheck(cudaEventCreateWithFlags(&event_, timing ? cudaEventDefault : cudaEventDisableTiming),
            "cudaEventCreateWithFlags");
}

CudaEvent::~CudaEvent() {
  if (event_ != nullptr) WarnIfFailed(cudaEventDestroy(event_), "cudaEventDestroy");
}

CudaEvent& CudaEvent::operator=(CudaEvent&& other) noexcept {
  if (this != &other) {
    if (event_ != nullptr) WarnIfFailed(cudaEventDestroy(event_), "cudaEventDestroy");
    event_ = other.event_;
    other.event_ = nullptr;
  }
  return *this;
}

CudaStream::CudaStream() {
  CudaCheck(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
}

CudaStream::~CudaStream() {
  if (stream_ != nullptr) {
    WarnIfFailed(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    WarnIfFailed(cudaStreamDestroy(stream_), "cudaStreamDestroy");
  }
}

void PrefaultReadOnly(const void* ptr, size_t bytes) {
  if (bytes == 0) return;
#ifdef MADV_POPULATE_READ
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(ptr) & ~(page - 1);
  const uintptr_t end = reinterpret_cast<uintptr_t>(ptr) + bytes;
  if (madvise(reinterpret_cast<void*>(begin), end - begin, MADV_POPULATE_READ) == 0) return;
#endif
  const size_t page_size = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const volatile uint8_t* p = static_cast<const volatile uint8_t*>(ptr);
  uint8_t sink = 0;
  for (size_t i = 0; i < bytes; i += page_size) sink ^= p[i];
  sink ^= p[bytes - 1];
  (void)sink;
}

bool HostRegistration::Register(const void* ptr, size_t bytes, std::string* error) {
  LS_CHECK(ptr_ == nullptr, "HostRegistration registered twice");
  PrefaultReadOnly(ptr, bytes);
  // Whole pages (the mapping covers them; the store's segments start page-aligned and their
  // mapped length is page-rounded): the driver pins pages either way.
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(ptr) & ~(page - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(ptr) + bytes + page - 1) & ~(page - 1);
  void* p = reinterpret_cast<void*>(begin);  // read-only registration: the GPU only reads it
  const cudaError_t status =
      cudaHostRegister(p, end - begin, cudaHostRegisterReadOnly | cudaHostRegisterPortable);
  if (status == cudaSuccess) {
    ptr_ = p;
    return true;
  }
  cudaGetLastError();
  if (status == cudaErrorHostMemoryAlreadyRegistered) return true;  // someone else owns it
  *error = std::string(cudaGetErrorName(status)) + " (" + cudaGetErrorString(status) + ")";
  return false;
}

HostRegistration::~HostRegistration() {
  if (ptr_ != nullptr) WarnIfFailed(cudaHostUnregister(ptr_), "cudaHostUnregister");
}

HostRegistration::HostRegistration(HostRegistration&& other) noexcept : ptr_(other.ptr_) {
  other.ptr_ = nullptr;
}

namespace {
class CudaRegisteredRange : public RegisteredRange {
 public:
  HostRegistration registration;
};
}  // namespace

std::unique_ptr<RegisteredRange> CudaHostRegistrar::Register(const void* ptr, uint64_t bytes,
                                                             std::string* error) {
  auto range = std::make_unique<CudaRegisteredRange>();
  if (!range->registration.Register(ptr, bytes, error)) return nullptr;
  return range;
}

PinnedBuffer::PinnedBuffer(size_t bytes) : bytes_(bytes) {
  CudaCheck(cudaHostAlloc(&ptr_, bytes, cudaHostAllocPortable), "cudaHostAlloc (staging)");
}

PinnedBuffer::~PinnedBuffer() {
  if (ptr_ != nullptr) WarnIfFailed(cudaFreeHost(ptr_), "cudaFreeHost");
}

DeviceBuffer::DeviceBuffer(size_t bytes) { CudaCheck(cudaMalloc(&ptr_, bytes), "cudaMalloc"); }

DeviceBuffer::~DeviceBuffer() {
  if (ptr_ != nullptr) WarnIfFailed(cudaFree(ptr_), "cudaFree");
}

}  // namespace lorastream::worker
