// A diffusion family's frozen base packed per streaming unit in this process's host memory,
// in the store's layout (one contiguous, page-aligned region per unit: one H2D copy moves a
// unit), and the tensors outside the units copied to the device.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "common/manifest.h"
#include "worker/model/dit_ops.h"
#include "worker/stream/stream_plan.h"

namespace lorastream::worker {

// `n` zeroed host bytes starting on a page boundary, as a store's segments do: a view of a
// HostBytes (worker/stream/host_bytes.h: every page the bytes touch is its own) that the
// tensor keeps.
at::Tensor PageAlignedHostBytes(uint64_t n);

// The checkpoint's tensor of a canonical name (only read), in any dtype.
using SourceTensor = std::function<at::Tensor(const std::string& name)>;

// One buffer per block segment of `m` (every tensor converted into m.dtype at its offset);
// each segment's shm_name becomes "PREFIX-unit-U".
std::vector<at::Tensor> PackUnitBuffers(Manifest& m, const SourceTensor& source,
                                        const std::string& prefix);
// The rest segment's tensors on `device` in `dtype`, by name.
dit::NamedTensors LoadRestTensors(const SegmentInfo& rest, const SourceTensor& source,
                                  c10::Device device, c10::ScalarType dtype);
// The buffers' first bytes.
std::vector<const uint8_t*> BufferPointers(const std::vector<at::Tensor>& buffers);
// The plan of `blocks_to_swap` of `units` streamed through `ring_size` slots; more than the
// model has refused (kRefused) naming `key` ("flux.blocks_to_swap").
ResidencyPlan UnitSwapPlan(int units, int64_t blocks_to_swap, int64_t ring_size,
                           const std::string& key);

}  // namespace lorastream::worker
