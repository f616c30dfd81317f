#include "worker/stream/stream_engine.h"

#include <algorithm>
#include <chrono>

#include <ATen/ops/empty.h>

#include "common/base/error.h"
#include "common/base/log.h"
#include "worker/model/base_weights.h"
#include "worker/model/quant_expand.h"
#include "worker/stream/stream_cpu_backend.h"
#ifdef LORASTREAM_HAVE_CUDA
#include "worker/stream/cuda/cuda_stream_backend.h"
#endif

namespace lorastream::worker {

namespace {

std::vector<SegmentInfo> CheckedLayouts(const Manifest& manifest,
                                        const std::vector<const uint8_t*>& sources,
                                        const ResidencyPlan& residency) {
  const size_t n = manifest.blocks.size();
  if (sources.size() != n || static_cast<size_t>(residency.num_blocks()) != n) {
    throw Error(ErrorCode::kInvalidArgument,
                "stream engine: the manifest has " + std::to_string(n) + " blocks, but " +
                    std::to_string(sources.size()) + " block addresses and a plan for " +
                    std::to_string(residency.num_blocks()) + " were given");
  }
  for (size_t i = 0; i < n; ++i) {
    if (sources[i] == nullptr) {
      throw Error(ErrorCode::kInvalidArgument,
                  "stream engine: no host address for block " + std::to_string(i));
    }
    for (const TensorSlice& t : manifest.blocks[i].tensors) {
      if (t.offset > manifest.blocks[i].nbytes || t.nbytes > manifest.blocks[i].nbytes - t.offset) {
        throw Error(ErrorCode::kCorrupt, "manifest: tensor model.layers." + std::to_string(i) +
                                             "." + t.name + " lies outside its segment (" +
                                             std::to_string(t.offset) + " + " +
                                             std::to_string(t.nbytes) + " > " +
                                             std::to_string(manifest.blocks[i].nbytes) + ")");
      }
    }
  }
  if (residency.num_streamed() > 0) RequireValidRingSize(residency.ring_size);
  return manifest.blocks;
}

void RefuseIfTrainable(const at::Tensor& t, int block, const std::string& name) {
  if (t.defined() && t.requires_grad()) {
    RefuseTrainableBaseWeight(t, "model.layers." + std::to_string(block) + "." + name);
  }
}

}  // namespace

void RefuseTrainableBaseWeight(const at::Tensor& weight, const std::string& name) {
  if (weight.defined() && weight.requires_grad()) {
    throw Error(ErrorCode::kRefused,
                "base weight " + name +
                    " requires grad: base weights are frozen and shared read-only; train it "
                    "through a LoRA adapter (lora.targets) and leave requires_grad off");
  }
}

void RefuseTrainableBaseWeights(const BlockWeights& w, int block) {
  RefuseIfTrainable(w.input_norm, block, "input_layernorm.weight");
  RefuseIfTrainable(w.q_proj, block, "self_attn.q_proj.weight");
  RefuseIfTrainable(w.k_proj, block, "self_attn.k_proj.weight");
  RefuseIfTrainable(w.v_proj, block, "self_attn.v_proj.weight");
  RefuseIfTrainable(w.o_proj, block, "self_attn.o_proj.weight");
  RefuseIfTrainable(w.q_bias, block, "self_attn.q_proj.bias");
  RefuseIfTrainable(w.k_bias, block, "self_attn.k_proj.bias");
  RefuseIfTrainable(w.v_bias, block, "self_attn.v_proj.bias");
  RefuseIfTrainable(w.q_norm, block, "self_attn.q_norm.weight");
  RefuseIfTrainable(w.k_norm, block, "self_attn.k_norm.weight");
  RefuseIfTrainable(w.post_norm, block, "post_attention_layernorm.weight");
  RefuseIfTrainable(w.gate_proj, block, "mlp.gate_proj.weight");
  RefuseIfTrainable(w.up_proj, block, "mlp.up_proj.weight");
  RefuseIfTrainable(w.down_proj, block, "mlp.down_proj.weight");
  RefuseIfTrainable(w.router, block, "router");
  for (size_t e = 0; e < w.experts.size(); ++e)
    for (const at::Tensor& t : w.experts[e])
      RefuseIfTrainable(t, block, "expert " + std::to_string(e));
  for (const auto& [name, t] : w.named)
    if (t.requires_grad())
      RefuseTrainableBaseWeight(t, "block " + std::to_string(block) + " " + name);
}

StreamEngine::StreamEngine(const Manifest& manifest, std::vector<const uint8_t*> block_bytes,
                           ResidencyPlan residency, std::unique_ptr<StreamBackend> backend,
                           bool log_plan)
    : layouts_(CheckedLayouts(manifest, block_bytes, residency)),
      dtype_(ScalarTypeOf(manifest.dtype, "the stream's weights")),
      naming_(BlockNamingOf(manifest)),
      sources_(std::move(block_bytes)),
      residency_(std::move(residency)),
      backend_(std::move(backend)) {
  const int n = num_blocks();
  resident_bytes_.resize(n);
  resident_weights_.resize(n);
  compressed_.assign(n, false);
  // Preparing the streamed sources is where the CUDA backend prefaults and registers them
  // (read-only, page-locked); its cost per GiB is worth a line in the log.
  double prepare_seconds = 0;
  uint64_t streamed_bytes = 0;
  for (int i = 0; i < n; ++i) {
    compressed_[i] = HasCompressedWeights(layouts_[i]);
    if (compressed_[i])
      scratch_elements_ = std::max(scratch_elements_, ExpandedElements(layouts_[i]));
    if (residency_.streamed[i]) {
      const auto start = std::chrono::steady_clock::now();
      backend_->AddSource(sources_[i], layouts_[i].nbytes);
      prepare_seconds +=
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      streamed_bytes += layouts_[i].nbytes;
    } else {
      resident_bytes_[i] = backend_->MakeResident(sources_[i], layouts_[i].nbytes);
      resident_weights_[i] = WeightsOf(resident_bytes_[i], i);
      RefuseTrainableBaseWeights(resident_weights_[i], i);
      // A resident run may be captured as a CUDA graph: its scratch exists before any use.
      if (compressed_[i] && !scratch_.defined())
        scratch_ = at::empty({scratch_elements_}, resident_bytes_[i].options().dtype(dtype_));
    }
  }
  if (scratch_.defined() && scratch_.numel() < scratch_elements_)
    scratch_ = at::empty({scratch_elements_}, scratch_.options());
  slot_weights_.resize(residency_.max_slots());
  slot_weights_block_.assign(residency_.max_slots(), -1);
  slot_block_.assign(residency_.max_slots(), -1);
  if (log_plan) {
    const PassPlan steady = PlanSteadyPass(residency_);
    uint64_t steady_bytes = 0;
    for (const BlockUse& u : steady.uses) {
      if (u.copy) steady_bytes += layouts_[u.block].nbytes;
    }
    LS_LOG_INFO(
        "stream engine: {}; steady pass: {} copies ({:.2f} GB), {} uses served from "
        "a slot",
        residency_.Describe(), steady.copies(), steady_bytes / 1e9, steady.copies_saved());
    if (streamed_bytes > 0)
      LS_LOG_INFO(
          "stream engine: prepared {} streamed bytes for copying in {:.3f} s "
          "({:.3f} s/GiB)",
          streamed_bytes, prepare_seconds,
          prepare_seconds / (static_cast<double>(streamed_bytes) / (1ull << 30)));
    if (residency_.num_streamed() > 0) LS_LOG_DEBUG("steady pass plan:\n{}", steady.Describe());
  }
  // Prefetch the first pass's blocks right away: the ring is empty, nothing to wait for.
  StartPass();
}

StreamEngine::~StreamEngine() {
  try {
    backend_->Drain();  // no copy may still write a slot while the backend frees it
  } catch (const std::exception& e) {
    LS_LOG_WARN("stream engine: a copy failed during shutdown: {}", e.what());
  }
}

void StreamEngine::StartPass() {
  scratch_block_ = -1;
  pass_ = PlanPass(residency_, slot_block_);
  cursor_ = 0;
  acquired_ = false;
  for (int u : pass_.issue_at_start) Issue(u);
}

void StreamEngine::FreePhaseSlot(int slot) {
  // The views over the slot go first: they hold its memory.
  slot_weights_[slot] = BlockWeights{};
  slot_weights_block_[slot] = -1;
  slot_block_[slot] = -1;
  backend_->FreeSlot(slot);
}

void StreamEngine::Issue(int use) {
  const BlockUse& u = pass_.uses[use];
  const uint64_t bytes = layouts_[u.block].nbytes;
  backend_->Copy(u.slot, sources_[u.block], bytes);
  slot_block_[u.slot] = u.block;
  h2d_bytes_ += bytes;
  ++copies_;
}

const BlockUse& StreamEngine::Expect(int block, const char* verb) const {
  LS_CHECK(cursor_ < static_cast<int>(pass_.uses.size()), "pass cursor past its end");
  const BlockUse& use = pass_.uses[cursor_];
  if (use.block != block) {
    throw Error(ErrorCode::kInternal,
                std::string("stream engine: ") + verb + "(" + std::to_string(block) +
                    ") out of order: use #" + std::to_string(cursor_) + " of the pass is " +
                    (use.backward ? "backward" : "forward") + " of block " +
                    std::to_string(use.block) + " (order: 0..L-1 then L-1..0)");
  }
  return use;
}

void StreamEngine::BeginStep() {
  if (cursor_ != 0 || acquired_) {
    // An unfinished pass (aborted step, forward-only pass): let its copies land, then plan
    // afresh from what the slots hold.
    if (acquired_ && pass_.uses[cursor_].slot >= 0) {
      backend_->ReleaseSlot(pass_.uses[cursor_].slot);
    }
    backend_->Drain();
    // A fresh pass starts with the phase slots that outlive a pass boundary at most.
    for (int s = residency_.pass_boundary_slots(); s < residency_.max_slots(); ++s) {
      if (slot_block_[s] >= 0) FreePhaseSlot(s);
    }
    StartPass();
  }
  // Statistics are not reset here: copies issued since the last EndStep (the first pass's
  // prefetch at construction) belong to this step's work. EndStep resets them.
  backend_->ResetPeak();
}

const BlockWeights& StreamEngine::Acquire(int block) {
  if (acquired_) {
    throw Error(ErrorCode::kInternal,
                "stream engine: Acquire(" + std::to_string(block) + ") while block " +
                    std::to_string(pass_.uses[cursor_].block) + " is still acquired");
  }
  const BlockUse& use = Expect(block, "Acquire");
  // Copies into phase slots wait for their phase to begin (worker/stream/stream_plan.h).
  for (int u : pass_.issue_at_acquire[cursor_]) Issue(u);
  const BlockWeights* weights = &resident_weights_[block];
  if (use.slot >= 0) {
    backend_->AcquireSlot(use.slot);
    if (!use.copy) ++copies_saved_;
    if (slot_weights_block_[use.slot] != block) {
      slot_weights_[use.slot] = WeightsOf(backend_->slot(use.slot), block);
      RefuseTrainableBaseWeights(slot_weights_[use.slot], block);
      slot_weights_block_[use.slot] = block;
    }
    weights = &slot_weights_[use.slot];
  }
  acquired_ = true;
  if (!compressed_[block]) return *weights;
  if (scratch_block_ != block) {
    // On the compute stream: behind the slot's copy (AcquireSlot) and every kernel of the
    // block before, which read the scratch.
    const at::Tensor& bytes = use.slot >= 0 ? backend_->slot(use.slot) : resident_bytes_[block];
    if (!scratch_.defined())
      scratch_ = at::empty({scratch_elements_}, bytes.options().dtype(dtype_));
    scratch_weights_ = *weights;
    ExpandProjections(bytes, layouts_[block], dtype_, &scratch_, &scratch_weights_, naming_);
    RefuseTrainableBaseWeights(scratch_weights_, block);
    scratch_block_ = block;
  }
  return scratch_weights_;
}

BlockWeights StreamEngine::WeightsOf(const at::Tensor& bytes, int block) const {
  if (!compressed_[block]) return BlockWeightsFromBytes(bytes, layouts_[block], naming_);
  return PlainBlockWeights(bytes, layouts_[block], dtype_, naming_);
}

void StreamEngine::Release(int block) {
  if (!acquired_) {
    throw Error(ErrorCode::kInternal,
                "stream engine: Release(" + std::to_string(block) + ") without an Acquire");
  }
  const BlockUse& use = Expect(block, "Release");
  // The release is recorded before the copies that follow it are issued: those copies wait
  // for it (invariant 2).
  if (use.slot >= 0) backend_->ReleaseSlot(use.slot);
  acquired_ = false;
  const int released = cursor_++;
  for (int s : pass_.free_after_release[released]) FreePhaseSlot(s);
  for (int u : pass_.issue_after_release[released]) Issue(u);
  if (cursor_ == static_cast<int>(pass_.uses.size())) StartPass();
}

void StreamEngine::EndStep(StepStats& stats) {
  stats.h2d_bytes = h2d_bytes_;
  stats.copies = copies_;
  stats.copies_saved = copies_saved_;
  backend_->CollectTimes(&stats.h2d_busy_seconds, &stats.stall_seconds);
  stats.peak_device_bytes = backend_->PeakDeviceBytes();
  h2d_bytes_ = 0;
  copies_ = 0;
  copies_saved_ = 0;
}

namespace {

// What "as many as fit" fills up to: the budget, else the plan's own estimated peak.
uint64_t FillBound(const MemoryModelInputs& inputs, const ResidencyPlan& plan,
                   uint64_t gpu_memory_budget) {
  return gpu_memory_budget > 0 ? gpu_memory_budget : EstimateMemory(inputs, plan).total();
}

}  // namespace

ResidencyPlan ApplyPhaseSlots(const MemoryModelInputs& inputs, ResidencyPlan plan,
                              uint64_t gpu_memory_budget, int64_t forward_slots,
                              int64_t backward_slots) {
  const uint64_t peak = FillBound(inputs, plan, gpu_memory_budget);
  auto slots = [&](int64_t asked, int planned, bool forward) {
    if (asked == 0) return planned;
    if (asked > 0) return static_cast<int>(std::min<int64_t>(asked, 1 << 20));
    ResidencyPlan one = plan;
    one.forward_slots = one.backward_slots = one.ring_size;
    one = FillPhaseSlots(inputs, one, peak);
    return forward ? one.forward_slots : one.backward_slots;
  };
  if (forward_slots < -1 || backward_slots < -1) {
    throw Error(ErrorCode::kRefused,
                "stream.forward_slots and stream.backward_slots must be "
                ">= -1 (-1: as many as fit; 0: ring_size)");
  }
  const int f = slots(forward_slots, plan.forward_slots, true);
  const int b = slots(backward_slots, plan.backward_slots, false);
  // The backward's slots that also fit across the LM head (within the budget, else within
  // the peak of the plan with these slots) exist there already.
  const ResidencyPlan phased = WithPhaseSlots(plan, f, b, plan.head_slots);
  const uint64_t head_peak = std::max(peak, FillBound(inputs, phased, gpu_memory_budget));
  return FillHeadSlots(inputs, phased, head_peak);
}

ResidencyPlan PlanResidency(int64_t blocks_to_swap, uint64_t gpu_memory_budget, int64_t ring_size,
                            const MemoryModelInputs& inputs, int64_t forward_slots,
                            int64_t backward_slots, int64_t taped_blocks) {
  const int num_blocks = static_cast<int>(inputs.block_bytes.size());
  const int ring = static_cast<int>(std::clamp<int64_t>(ring_size, -1, 1 << 20));
  RequireValidRingSize(ring);
  ResidencyPlan plan;
  if (gpu_memory_budget > 0) {
    plan = PlanFromBudget(inputs, gpu_memory_budget, ring);
  } else {
    const int swap = static_cast<int>(std::clamp<int64_t>(blocks_to_swap, -1, num_blocks + 1));
    plan = PlanFromSwapCount(num_blocks, swap, ring);
  }
  plan = ApplyPhaseSlots(inputs, plan, gpu_memory_budget, forward_slots, backward_slots);
  plan = ApplyTapedBlocks(inputs, plan, gpu_memory_budget, taped_blocks);
  if (gpu_memory_budget == 0)
    LS_LOG_INFO("stream plan from blocks_to_swap {}: {}; estimate {}", blocks_to_swap,
                plan.Describe(), EstimateMemory(inputs, plan).Describe());
  return plan;
}

ResidencyPlan ApplyTapedBlocks(const MemoryModelInputs& inputs, ResidencyPlan plan,
                               uint64_t gpu_memory_budget, int64_t taped_blocks) {
  if (taped_blocks < -1)
    throw Error(ErrorCode::kRefused,
                "stream.taped_blocks must be 0 (the plan's), -1 (as many as fit) or a count "
                "(found " +
                    std::to_string(taped_blocks) + ")");
  if (taped_blocks > 0) {
    plan.taped_blocks = static_cast<int>(std::min<int64_t>(taped_blocks, plan.num_blocks()));
  } else if (taped_blocks == -1) {
    plan = FillTapedBlocks(inputs, plan, FillBound(inputs, plan, gpu_memory_budget));
  }
  return plan;
}

MemoryModelInputs MemoryInputsFor(const Manifest& manifest, int64_t lora_rank,
                                  const std::vector<std::string>& lora_targets,
                                  int64_t tokens_per_micro_batch, int compute_bytes,
                                  bool attention_materialized) {
  MemoryModelInputs in;
  in.config = manifest.config;
  for (const SegmentInfo& b : manifest.blocks) in.block_bytes.push_back(b.nbytes);
  if (manifest.quant().compressed())
    for (const SegmentInfo& b : manifest.blocks)
      in.expanded_bytes.push_back(static_cast<uint64_t>(ExpandedElements(b)) * compute_bytes);
  in.lora_rank = lora_rank;
  in.lora_targets = lora_targets;
  in.tokens = tokens_per_micro_batch;
  in.compute_bytes = compute_bytes;
  in.attention_materialized = attention_materialized;
  SetNonBlockBytes(&in);  // the embedding table stays in host RAM
  // A compressed head stays compressed on the device (resident or copied) and is expanded
  // per vocabulary slice.
  if (const TensorSlice* head = manifest.head(); head != nullptr && head->quant.compressed()) {
    in.head_bytes = CompressedSpanBytes(manifest.rest, *head);
    in.head_slice_rows = HeadSliceRows(head->shape[0], head->shape[1], head->quant);
  }
  return in;
}

StreamBackendOptions StreamBackendOptionsFor(const Manifest& manifest,
                                             const ResidencyPlan& residency,
                                             const StreamEngineOptions& options) {
  StreamBackendOptions b;
  b.num_slots = residency.max_slots();
  b.permanent_slots = residency.ring_size;
  for (size_t i = 0; i < manifest.blocks.size() && i < residency.streamed.size(); ++i) {
    if (residency.streamed[i]) b.slot_bytes = std::max(b.slot_bytes, manifest.blocks[i].nbytes);
  }
  b.debug_poison = options.debug_poison;
  b.debug_copy_delay_us = options.debug_copy_delay_us;
  b.force_staging = options.force_staging;
  return b;
}

std::unique_ptr<StreamEngine> MakeStreamEngine(const Manifest& manifest,
                                               std::vector<const uint8_t*> block_bytes,
                                               const ResidencyPlan& residency,
                                               const c10::Device& device,
                                               const StreamEngineOptions& options) {
  return std::make_unique<StreamEngine>(
      manifest, std::move(block_bytes), residency,
      MakeStreamBackend(StreamBackendOptionsFor(manifest, residency, options), device),
      options.log_plan);
}

std::unique_ptr<StreamBackend> MakeStreamBackend(const StreamBackendOptions& options,
                                                 const c10::Device& device) {
  if (device.is_cpu()) return std::make_unique<CpuStreamBackend>(options);
  if (device.is_cuda()) {
#ifdef LORASTREAM_HAVE_CUDA
    return MakeCudaStreamBackend(options, device.has_index() ? device.index() : 0);
#else
    throw Error(ErrorCode::kUnsupported,
                "device " + device.str() + ": this build of lorastream has no CUDA backend");
#endif
  }
  throw Error(ErrorCode::kUnsupported, "device " + device.str() + " is not supported");
}

}  // namespace lorastream::worker
