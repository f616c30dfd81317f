// A diffusion family's frozen base packed per streaming unit in this process's host memory,
// in the store's layout (one contiguous, page-aligned region per unit: one H2D copy moves a
// unit), and the tensors outside the units copied to the device.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "common/formats/manifest.h"
#include "worker/model/dit_ops.h"
#include "worker/stream/stream_plan.h"

namespace lorastream {
class SafetensorsFile;
struct SafetensorsEntry;
}  // namespace lorastream

namespace lorastream::store {
class AttachedStore;
}

namespace lorastream::worker {

// `n` zeroed host bytes starting on a page boundary, as a store's segments do: a view of a
// HostBytes (worker/stream/host_bytes.h: every page the bytes touch is its own) that the
// tensor keeps.
at::Tensor PageAlignedHostBytes(uint64_t n);

// The checkpoint's tensor of a canonical name (only read), in any dtype.
using SourceTensor = std::function<at::Tensor(const std::string& name)>;

// `entry` of `file` as a tensor over the file's read-only mapping, in its stored dtype (only
// read: converted into this process's own buffers); `what` names it where that dtype is
// refused (ScalarTypeOf).
at::Tensor MappedTensor(const SafetensorsFile& file, const SafetensorsEntry& entry,
                        const std::string& what);
// Refuses (kUnsupported) the checkpoint at `path`, read directly, whose tensor `tensor` is fp8
// (F8_E4M3): a job reads an fp8 checkpoint of `family` ("FLUX", "Qwen-Image") through a store
// serving it, which it names as `store_key` ("model.store").
[[noreturn]] void RefuseFp8Checkpoint(const std::string& path, const std::string& tensor,
                                      const std::string& family, const std::string& store_key);

// One buffer per block segment of `m` (every tensor converted into m.dtype at its offset);
// each segment's shm_name becomes "PREFIX-unit-U".
std::vector<at::Tensor> PackUnitBuffers(Manifest& m, const SourceTensor& source,
                                        const std::string& prefix);
// The rest segment's tensors on `device` in `dtype`, by name.
dit::NamedTensors LoadRestTensors(const SegmentInfo& rest, const SourceTensor& source,
                                  c10::Device device, c10::ScalarType dtype);
// The buffers' first bytes.
std::vector<const uint8_t*> BufferPointers(const std::vector<at::Tensor>& buffers);
// A diffusion family's store (lorastream-store serve PATH) attached read-only for training:
// its units stream from the shared mapping (nothing of them is copied in this process); the
// tensors outside the blocks are copied to `device` in `dtype`.
struct AttachedUnits {
  std::shared_ptr<const store::AttachedStore> store;  // the mapping the units are in
  // The store's manifest with `dtype` as its dtype: what the streaming engine is given (a
  // compressed unit's linears expanded into it at each use: worker/model/quant_expand.h).
  Manifest manifest;
  std::vector<const uint8_t*> unit_data;  // unit u's bytes
  dit::NamedTensors rest;
  std::string description;  // for the log: "store `NAME` (SOURCE[, linears ...])"
};
// Refuses (kRefused) store `name`, whose manifest is `m`, unless it serves model family
// `family` (Manifest::model_family()), naming the store's family and
// `serve_hint` (how the job names its family's store).
void RequireStoreFamily(const Manifest& m, const std::string& name, ModelFamily family,
                        const std::string& serve_hint);
// Store `name` of model family `family` (Manifest::model_family()),
// attached. Refuses (kRefused) a store of another family, naming the store's family and
// `serve_hint` (how the job names its family's store), and a plain store of another dtype
// than `dtype`, naming both and `dtype_key` (the job's key that sets it). A compressed store
// (`serve --quantize`) goes with any dtype: its units are copied compressed and expanded on
// the device (worker/stream/stream_engine.h).
AttachedUnits AttachUnitStore(const std::string& name, ModelFamily family,
                              const std::string& serve_hint, const std::string& dtype_key,
                              c10::ScalarType dtype, c10::Device device);

// The plan of `blocks_to_swap` of `units` streamed through `ring_size` slots; more than the
// model has refused (kRefused) naming `key` ("flux.blocks_to_swap").
ResidencyPlan UnitSwapPlan(int units, int64_t blocks_to_swap, int64_t ring_size,
                           const std::string& key);

}  // namespace lorastream::worker
