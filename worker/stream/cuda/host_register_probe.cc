#include "worker/stream/host_register_probe.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include <cuda_runtime_api.h>

#include "common/base/error.h"
#include "store/shm_segment.h"
#include "worker/stream/cuda/cuda_handles.h"

namespace lorastream::worker {

namespace {

uint8_t PatternByte(size_t i) { return static_cast<uint8_t>((i * 2654435761u) >> 13); }

}  // namespace

nlohmann::json ProbeHostRegister(int device_index, size_t bytes) {
  nlohmann::json r{{"device", "cuda:" + std::to_string(device_index)}, {"bytes", bytes}};
  auto fail = [&r](const std::string& step, const std::string& error) {
    r["ok"] = false;
    r["step"] = step;
    r["error"] = error;
    return r;
  };
  // Not under the stores' "lorastream." prefix: `store ls` never mistakes it for a store.
  const std::string name = "/lorastream-doctor-probe-" + std::to_string(getpid());
  try {
    // The owner writes, then only a read-only mapping of the object is registered (the
    // owner's writable one is gone by then, as a store's is MakeReadOnly()'d).
    store::ShmSegment owner =
        store::ShmSegment::Create(name, bytes, S_IRUSR | S_IWUSR, /*huge_pages=*/false);
    for (size_t i = 0; i < bytes; ++i) owner.mutable_data()[i] = PatternByte(i);
    owner.MakeReadOnly();
    store::ShmSegment view = store::ShmSegment::OpenReadOnly(name, bytes, /*populate=*/true);

    if (cudaError_t s = cudaSetDevice(device_index); s != cudaSuccess)
      return fail("cudaSetDevice", cudaGetErrorString(s));
    HostRegistration registration;
    std::string error;
    if (!registration.Register(view.data(), bytes, &error))
      return fail("cudaHostRegister(ReadOnly)", error);
    DeviceBuffer device(bytes);
    if (cudaError_t s = cudaMemcpy(device.get(), view.data(), bytes, cudaMemcpyHostToDevice);
        s != cudaSuccess)
      return fail("cudaMemcpy H2D", cudaGetErrorString(s));
    std::vector<uint8_t> back(bytes);
    if (cudaError_t s = cudaMemcpy(back.data(), device.get(), bytes, cudaMemcpyDeviceToHost);
        s != cudaSuccess)
      return fail("cudaMemcpy D2H", cudaGetErrorString(s));
    if (std::memcmp(back.data(), view.data(), bytes) != 0)
      return fail("compare", "the bytes copied to the GPU differ from the mapping's");
  } catch (const Error& e) {
    return fail("setup", e.what());
  }
  r["ok"] = true;
  return r;
}

}  // namespace lorastream::worker
