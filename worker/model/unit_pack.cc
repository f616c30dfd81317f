#include "worker/model/unit_pack.h"

#include <memory>

#include <ATen/ATen.h>

#include "common/error.h"
#include "worker/model/base_weights.h"
#include "worker/stream/host_bytes.h"

namespace lorastream::worker {

at::Tensor PageAlignedHostBytes(uint64_t n) {
  auto owner = std::make_shared<HostBytes>(HostBytes::Allocate(n, "model unit"));
  // The tensor's storage is every page of the allocation; the view is the `n` bytes asked for.
  const at::Tensor pages = at::from_blob(
      owner->data(), {static_cast<int64_t>(owner->mapped_size())}, [owner](void*) {},
      at::TensorOptions().dtype(at::kByte));
  return pages.narrow(0, 0, static_cast<int64_t>(n));
}

std::vector<at::Tensor> PackUnitBuffers(Manifest& m, const SourceTensor& source,
                                        const std::string& prefix) {
  const c10::ScalarType dtype = ScalarTypeOf(m.dtype, "the packed units");
  std::vector<at::Tensor> out;
  for (size_t u = 0; u < m.blocks.size(); ++u) {
    SegmentInfo& seg = m.blocks[u];
    seg.shm_name = prefix + "-unit-" + std::to_string(u);
    at::Tensor bytes = PageAlignedHostBytes(seg.nbytes);
    for (const auto& t : seg.tensors)
      bytes.narrow(0, static_cast<int64_t>(t.offset), static_cast<int64_t>(t.nbytes))
          .view(dtype)
          .view(t.shape)
          .copy_(source(t.name));
    out.push_back(bytes);
  }
  return out;
}

dit::NamedTensors LoadRestTensors(const SegmentInfo& rest, const SourceTensor& source,
                                  c10::Device device, c10::ScalarType dtype) {
  dit::NamedTensors out;
  for (const auto& t : rest.tensors)
    out[t.name] = source(t.name).to(device, dtype, /*non_blocking=*/false, /*copy=*/true);
  return out;
}

std::vector<const uint8_t*> BufferPointers(const std::vector<at::Tensor>& buffers) {
  std::vector<const uint8_t*> out;
  for (const auto& t : buffers) out.push_back(t.data_ptr<uint8_t>());
  return out;
}

ResidencyPlan UnitSwapPlan(int units, int64_t blocks_to_swap, int64_t ring_size,
                           const std::string& key) {
  if (blocks_to_swap > units)
    throw Error(ErrorCode::kRefused, key + " must be at most " + std::to_string(units) +
                                         " (the model's streaming units)");
  return PlanFromSwapCount(units, static_cast<int>(blocks_to_swap), static_cast<int>(ring_size));
}

}  // namespace lorastream::worker
