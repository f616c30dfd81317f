#include "worker/stream_provider.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstring>

#include <ATen/ATen.h>
#include <torch/version.h>

#include "common/error.h"
#include "common/job_spec.h"
#include "common/log.h"
#include "common/memory_mapping.h"
#include "store/shm_segment.h"
#include "worker/base_weights.h"

namespace lorastream {

namespace {

DType DTypeOf(c10::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::kF32;
    case at::kBFloat16: return DType::kBF16;
    case at::kHalf: return DType::kF16;
    case at::kDouble: return DType::kF64;
    default:
      throw Error(ErrorCode::kUnsupported,
                  std::string("stream: compute dtype ") + c10::toString(t) + " is not supported");
  }
}

const at::Tensor& Field(const BlockWeights& w, const std::string& name) {
  const at::Tensor* field = BlockWeightField(w, name);
  if (field == nullptr)
    throw Error(ErrorCode::kInternal, "stream: no BlockWeights field for `" + name + "`");
  return *field;
}

// Blocks packed as a store packs them (canonical order, 256-byte aligned offsets), each in
// its own page-aligned mapping, made read-only once filled, like the store's segments.
class PackedBlocks {
 public:
  PackedBlocks(const BaseWeights& base, c10::ScalarType dtype) {
    const ModelConfig& config = base.config();
    manifest_.store_name = "packed:" + base.name_or_path();
    manifest_.config = config;
    manifest_.dtype = DTypeOf(dtype);
    const uint64_t align = manifest_.alignment;
    for (int i = 0; i < base.num_blocks(); ++i) {
      SegmentInfo s = LayoutSegment(config.BlockTensorShapes(), "block " + std::to_string(i),
                                    manifest_.dtype, align);
      const size_t mapped = RoundUpToPage(s.nbytes);
      // Owned from here on: a throw below unmaps what was mapped so far.
      maps_.push_back(MemoryMapping::Map(mapped, PROT_READ | PROT_WRITE,
                                         MAP_PRIVATE | MAP_ANONYMOUS, -1, 0,
                                         "stream: mapping " + std::to_string(mapped) + " bytes"));
      uint8_t* bytes = maps_.back().bytes();
      for (const TensorSlice& t : s.tensors) {
        at::Tensor src = Field(base.block(i), t.name).to(at::kCPU, dtype).contiguous();
        LS_CHECK(static_cast<uint64_t>(src.nbytes()) == t.nbytes, "packed tensor size");
        std::memcpy(bytes + t.offset, src.data_ptr(), t.nbytes);
      }
      if (mprotect(bytes, mapped, PROT_READ) != 0) ThrowErrno("stream: mprotect of packed blocks");
      pointers_.push_back(bytes);
      manifest_.blocks.push_back(std::move(s));
    }
    // Only the size of the rest matters here (the memory estimate).
    manifest_.rest = LayoutSegment(config.RestTensorShapes(), "rest", manifest_.dtype, align);
  }
  PackedBlocks(const PackedBlocks&) = delete;
  PackedBlocks& operator=(const PackedBlocks&) = delete;

  const Manifest& manifest() const { return manifest_; }
  const std::vector<const uint8_t*>& pointers() const { return pointers_; }

 private:
  Manifest manifest_;
  std::vector<const uint8_t*> pointers_;
  std::vector<MemoryMapping> maps_;
};

// The engine plus, when the base had to be packed, the host buffers it streams from
// (declared first: destroyed after the engine, whose copies read them).
class StreamProvider : public BlockProvider {
 public:
  StreamProvider(std::unique_ptr<PackedBlocks> packed, std::unique_ptr<StreamEngine> engine)
      : packed_(std::move(packed)), engine_(std::move(engine)) {}
  int num_blocks() const override { return engine_->num_blocks(); }
  void BeginStep() override { engine_->BeginStep(); }
  const BlockWeights& Acquire(int block) override { return engine_->Acquire(block); }
  void Release(int block) override { engine_->Release(block); }
  void EndStep(StepStats& stats) override { engine_->EndStep(stats); }

 private:
  std::unique_ptr<PackedBlocks> packed_;
  std::unique_ptr<StreamEngine> engine_;
};

}  // namespace

std::unique_ptr<BlockProvider> MakeStreamProvider(const JobSpec& spec, const BaseWeights& base,
                                                  const std::string& device_name,
                                                  const std::string& dtype_name,
                                                  const StreamEngineOptions& options) {
  const c10::Device device(device_name == "cuda" ? std::string("cuda:0") : device_name);
  const c10::ScalarType dtype = dtype_name == "bf16" ? at::kBFloat16 : at::kFloat;

  std::unique_ptr<PackedBlocks> packed;
  const Manifest* manifest = base.manifest();
  std::vector<const uint8_t*> pointers = base.block_bytes();
  if (manifest == nullptr || ScalarTypeOf(manifest->dtype, "the store") != dtype) {
    // Streaming serves stored bytes as they are: bring them into the compute dtype once.
    LS_LOG_INFO("stream: packing {} blocks of {} as {} into host buffers ({})", base.num_blocks(),
                base.name_or_path(), dtype_name,
                manifest == nullptr ? "the base is a checkpoint folder, not a store"
                                    : "the store's dtype differs from the compute dtype");
    packed = std::make_unique<PackedBlocks>(base, dtype);
    manifest = &packed->manifest();
    pointers = packed->pointers();
  }

  // Attention without a fused kernel (LibTorch 1.x, or the CPU) materialises its scores.
  const bool materialized = !device.is_cuda() || TORCH_VERSION_MAJOR < 2;
  const MemoryModelInputs inputs =
      MemoryInputsFor(*manifest, spec.lora.rank, spec.lora.targets,
                      spec.train.batch_size * spec.data.seq_len,
                      static_cast<int>(c10::elementSize(dtype)), materialized);
  const ResidencyPlan plan = PlanResidency(spec.stream.blocks_to_swap, spec.stream.gpu_memory_budget,
                                           spec.stream.ring_size, inputs);
  // The trainer always checkpoints every block (worker/checkpointed_block.cc).
  RequireCheckpointingForStreaming(plan, /*gradient_checkpointing=*/true);
  auto engine = MakeStreamEngine(*manifest, pointers, plan, device, options);
  return std::make_unique<StreamProvider>(std::move(packed), std::move(engine));
}

}  // namespace lorastream
