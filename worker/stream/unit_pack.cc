#include "worker/stream/unit_pack.h"

#include <memory>

#include <ATen/ATen.h>

#include "common/base/error.h"
#include "common/formats/safetensors.h"
#include "store/attach.h"
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

at::Tensor MappedTensor(const SafetensorsFile& file, const SafetensorsEntry& entry,
                        const std::string& what) {
  return at::from_blob(const_cast<uint8_t*>(file.Data(entry)), entry.shape,
                       at::TensorOptions().dtype(ScalarTypeOf(entry.dtype, what)));
}

void RefuseFp8Checkpoint(const std::string& path, const std::string& tensor,
                         const std::string& family, const std::string& store_key) {
  throw Error(ErrorCode::kUnsupported,
              path + ": tensor `" + tensor + "` is fp8 (F8_E4M3); a job reads an fp8 " + family +
                  " checkpoint through a store: lorastream-store serve " + path +
                  " --name NAME, then " + store_key + " = \"NAME\"");
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

void RequireStoreFamily(const Manifest& m, const std::string& name, ModelFamily family,
                        const std::string& serve_hint) {
  if (m.model_family() != family)
    throw Error(ErrorCode::kRefused, "store `" + name + "` serves " + m.family() + ", not " +
                                         ModelFamilyName(family) + " (" + serve_hint + ")");
}

AttachedUnits AttachUnitStore(const std::string& name, ModelFamily family,
                              const std::string& serve_hint, const std::string& dtype_key,
                              c10::ScalarType dtype, c10::Device device) {
  auto store = std::make_shared<store::AttachedStore>(store::AttachedStore::Attach(name));
  const Manifest& m = store->manifest();
  RequireStoreFamily(m, name, family, serve_hint);
  const std::string where = "store `" + name + "`";
  // A compressed store's units are copied as stored and expanded into the compute dtype where
  // they are used (the engine's manifest says that dtype); a plain store's are served as
  // stored, so its dtype must be the job's.
  const bool compressed = m.quant().compressed();
  if (!compressed && m.dtype != DTypeOf(dtype))
    throw Error(ErrorCode::kRefused,
                where + " holds " + DTypeName(m.dtype) + " weights but the job computes in " +
                    DTypeName(DTypeOf(dtype)) + ": set " + dtype_key + " = \"" +
                    (m.dtype == DType::kBF16 ? "bf16" : "f32") + "\" (a " +
                    ModelFamilyName(family) + " job computes in its store's dtype)");
  AttachedUnits a;
  a.manifest = m;  // the units stream straight from the read-only mapping
  a.manifest.dtype = DTypeOf(dtype);
  for (int u = 0; u < store->num_blocks(); ++u) a.unit_data.push_back(store->block_data(u));
  for (const TensorSlice& t : m.rest.tensors) {
    const at::Tensor view =
        at::from_blob(const_cast<uint8_t*>(store->rest_data() + t.offset), t.shape,
                      at::TensorOptions().dtype(ScalarTypeOf(t.dtype, t.name)));
    a.rest[t.name] = view.to(device, dtype, /*non_blocking=*/false, /*copy=*/true);
  }
  a.description = where + " (" + (m.source_dir.empty() ? "shared memory" : m.source_dir) +
                  (compressed ? ", linears " + DescribeQuant(m.quant()) + ", expanded to " +
                                    DTypeName(DTypeOf(dtype)) + " at each use"
                              : std::string()) +
                  ")";
  a.store = std::move(store);
  return a;
}

}  // namespace lorastream::worker
