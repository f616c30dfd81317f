#include "worker/train/stream_provider.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <tuple>
#include <utility>

#include <ATen/ATen.h>
#include <torch/version.h>

#include "common/base/error.h"
#include "common/base/format_bytes.h"
#include "common/base/log.h"
#include "common/job/job_spec.h"
#include "common/posix/memory_limit.h"
#include "worker/model/base_weights.h"
#include "worker/model/fused_ops.h"
#include "worker/model/torch_device.h"
#include "worker/stream/host_bytes.h"
#include "worker/stream/stream_cost.h"
#include "worker/stream/streamed_head.h"
#include "worker/train/stream_calibrate.h"
#ifdef LORASTREAM_HAVE_CUDA
#include "worker/stream/cuda/cuda_memory.h"
#endif

namespace lorastream::worker {

namespace {

const at::Tensor& Field(const BlockWeights& w, const std::string& name) {
  const at::Tensor* field = BlockWeightField(w, name);
  if (field == nullptr)
    throw Error(ErrorCode::kInternal, "stream: no BlockWeights field for `" + name + "`");
  return *field;
}

// Blocks packed as a store packs them (canonical order, 256-byte aligned offsets), each in
// its own HostBytes, made read-only once filled, like the store's segments.
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
      // Owned from here on: a throw below unmaps what was mapped so far.
      blocks_.push_back(HostBytes::Allocate(s.nbytes, "stream: block " + std::to_string(i)));
      uint8_t* bytes = blocks_.back().data();
      for (const TensorSlice& t : s.tensors) {
        at::Tensor src = Field(base.block(i), t.name).to(at::kCPU, dtype).contiguous();
        LS_CHECK(static_cast<uint64_t>(src.nbytes()) == t.nbytes, "packed tensor size");
        std::memcpy(bytes + t.offset, src.data_ptr(), t.nbytes);
      }
      blocks_.back().MakeReadOnly();
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
  std::vector<HostBytes> blocks_;
};

// The engine plus, when the base had to be packed, the host buffers it streams from
// (declared first: destroyed after the engine, whose copies read them), and the LM head
// when the plan streams it.
// The memory a plan was checked against: the planned job's inputs (without its group) and the
// limit, the job's budget or else the device's memory.
struct PlannedMemory {
  MemoryModelInputs inputs;
  uint64_t limit = 0;
  std::string limit_what;  // "the plan's budget (...)", "the host's memory (cpu)"
};

class StreamProvider : public BlockProvider {
 public:
  StreamProvider(std::unique_ptr<PackedBlocks> packed, std::unique_ptr<StreamEngine> engine,
                 std::unique_ptr<HeadProvider> head, double predicted_step_seconds,
                 PlannedMemory memory)
      : packed_(std::move(packed)),
        engine_(std::move(engine)),
        head_(std::move(head)),
        predicted_(predicted_step_seconds),
        memory_(std::move(memory)) {}
  int num_blocks() const override { return engine_->num_blocks(); }
  void BeginStep() override {
    // A step runs from one BeginStep to the next (optimizer included): the planner's
    // prediction is logged next to what it measured.
    const auto now = std::chrono::steady_clock::now();
    if (predicted_ > 0 && steps_ > 0) {
      const double measured = std::chrono::duration<double>(now - last_begin_).count();
      // The first steps (the first is cold) and then one in a hundred at info level.
      if (steps_ <= 5 || steps_ % 100 == 0) {
        LS_LOG_INFO("stream: step {} took {:.1f} ms, predicted {:.1f} ms ({:+.1f}%)", steps_,
                    measured * 1e3, predicted_ * 1e3, (measured / predicted_ - 1) * 100);
      } else {
        LS_LOG_DEBUG("stream: step {} took {:.1f} ms, predicted {:.1f} ms", steps_, measured * 1e3,
                     predicted_ * 1e3);
      }
    }
    last_begin_ = now;
    ++steps_;
    engine_->BeginStep();
  }
  const BlockWeights& Acquire(int block) override { return engine_->Acquire(block); }
  void Release(int block) override {
    const int use = engine_->next_use();
    engine_->Release(block);
    // The plan's point for a streamed head's copy: the forward has freed room for it.
    if (head_ && use == engine_->pass_plan().head_copy_after) head_->Prefetch();
  }
  void EndStep(StepStats& stats) override {
    engine_->EndStep(stats);
    if (head_) head_->CollectStats(stats);  // the head's copy counts with the blocks'
  }
  HeadProvider* lm_head() override { return head_.get(); }
  int taped_blocks() const override { return engine_->residency().taped_blocks; }
  bool step_is_host_only() const override {
    return head_ == nullptr && engine_->step_is_host_only();
  }
  std::string JoinRefusal(const std::vector<JobSpec>& others) const override {
    if (others.empty()) return "";
    MemoryModelInputs in = memory_.inputs;
    AddGroupJobs(others, &in);
    return GroupJoinProblem(others.back().name, others.size(),
                            EstimateMemory(in, engine_->residency()).total(), memory_.limit,
                            memory_.limit_what);
  }

 private:
  std::unique_ptr<PackedBlocks> packed_;
  std::unique_ptr<StreamEngine> engine_;
  std::unique_ptr<HeadProvider> head_;  // null: the head stays resident (the trainer's)
  const double predicted_;              // seconds per step; 0: no prediction
  const PlannedMemory memory_;
  std::chrono::steady_clock::time_point last_begin_;
  int64_t steps_ = 0;
};

// A plan whose estimated peak exceeds the device's memory (the host's on the CPU) would only
// grow until the machine gives out: refused before anything is allocated.
void RefuseBeyondDeviceMemory(uint64_t estimate, const c10::Device& device) {
  const auto [limit, what] = DeviceMemory(device);
  if (std::string why = MemoryLimitProblem(estimate, limit, what); !why.empty())
    throw Error(ErrorCode::kRefused, why);
}

}  // namespace

std::pair<uint64_t, std::string> DeviceMemory(const c10::Device& device) {
  if (device.is_cuda()) {
#ifdef LORASTREAM_HAVE_CUDA
    return {CudaTotalBytes(device.has_index() ? device.index() : 0), device.str()};
#else
    return {0, device.str()};
#endif
  }
  return {HostMemoryBytes(), "the host's memory (" + device.str() + ")"};
}

std::unique_ptr<BlockProvider> MakeStreamProvider(const JobSpec& spec, const BaseWeights& base,
                                                  const std::string& device_name,
                                                  const std::string& dtype_name,
                                                  const StreamEngineOptions& options,
                                                  const std::vector<JobSpec>& group) {
  const Device typed_device = ParseDevice(device_name);
  const c10::Device device = TorchDevice(typed_device);
  const c10::ScalarType dtype =
      ScalarTypeOf(ComputeDType(dtype_name, typed_device), "the compute dtype");

  std::unique_ptr<PackedBlocks> packed;
  const Manifest* manifest = base.manifest();
  std::vector<const uint8_t*> pointers = base.block_bytes();
  Manifest compressed;
  if (manifest != nullptr && manifest->quant().compressed()) {
    // Compressed blocks stream as stored and expand on the device, into the compute dtype.
    compressed = ComputeLayout(base, dtype);
    manifest = &compressed;
  } else if (manifest == nullptr || ScalarTypeOf(manifest->dtype, "the store") != dtype) {
    // Streaming serves stored bytes as they are: bring them into the compute dtype once.
    LS_LOG_INFO("stream: packing {} blocks of {} as {} into host buffers ({})", base.num_blocks(),
                base.name_or_path(), dtype_name,
                manifest == nullptr ? "the base is a checkpoint folder, not a store"
                                    : "the store's dtype differs from the compute dtype");
    packed = std::make_unique<PackedBlocks>(base, dtype);
    manifest = &packed->manifest();
    pointers = packed->pointers();
  }

  PlannedMemory memory;
  memory.inputs = JobMemoryInputs(spec, *manifest, device, dtype);
  MemoryModelInputs inputs = memory.inputs;
  AddGroupJobs(group, &inputs);
  const StreamPlanning planning = PlanJobStream(spec, base, inputs, device, dtype, group);
  RefuseBeyondDeviceMemory(EstimateMemory(inputs, planning.plan).total(), device);
  if (planning.budget > 0) {
    memory.limit = planning.budget;
    memory.limit_what = "the plan's budget (stream.gpu_memory_budget)";
  } else {
    std::tie(memory.limit, memory.limit_what) = DeviceMemory(device);
  }
  // The trainer always checkpoints every block (worker/model/checkpointed_block.cc).
  RequireCheckpointingForStreaming(planning.plan, /*gradient_checkpointing=*/true);
  auto engine = MakeStreamEngine(*manifest, pointers, planning.plan, device, options);
  std::unique_ptr<HeadProvider> head;
  // A tied model's head is its embedding table (BaseWeights::rest().lm_head is that view).
  if (planning.plan.head_streamed) head = MakeStreamedHead(base.rest(), device, dtype, options);
  return std::make_unique<StreamProvider>(std::move(packed), std::move(engine), std::move(head),
                                          planning.predicted_step_seconds, std::move(memory));
}

MemoryModelInputs JobMemoryInputs(const JobSpec& spec, const Manifest& manifest,
                                  const c10::Device& device, c10::ScalarType dtype) {
  // Attention without a fused kernel (LibTorch 1.x, or the CPU) materialises its scores.
  const bool materialized = !device.is_cuda() || TORCH_VERSION_MAJOR < 2;
  MemoryModelInputs in = MemoryInputsFor(manifest, spec.lora.rank, spec.lora.targets,
                                         spec.train.batch_size * spec.data.seq_len,
                                         static_cast<int>(c10::elementSize(dtype)), materialized);
  in.fused_cross_entropy = FusedCrossEntropyApplies(device.is_cuda(), dtype);
  in.lora_dropout = spec.lora.dropout;
  in.eight_bit_optimizer = spec.optim.type == "adamw8bit";
  return in;
}

void AddGroupJobs(const std::vector<JobSpec>& others, MemoryModelInputs* inputs) {
  for (const JobSpec& s : others)
    inputs->group.push_back({s.name, s.train.batch_size * s.data.seq_len, s.lora.rank,
                             s.lora.dropout, s.lora.targets, s.optim.type == "adamw8bit"});
}

Manifest ComputeLayout(const BaseWeights& base, c10::ScalarType dtype) {
  const Manifest* stored = base.manifest();
  if (stored != nullptr && ScalarTypeOf(stored->dtype, "the store") == dtype) return *stored;
  if (stored != nullptr && stored->quant().compressed()) {
    Manifest m = *stored;  // streamed as stored; the engine expands into m.dtype
    m.dtype = DTypeOf(dtype);
    return m;
  }
  Manifest m;
  m.config = base.config();
  m.dtype = DTypeOf(dtype);
  for (int i = 0; i < base.num_blocks(); ++i) {
    m.blocks.push_back(LayoutSegment(m.config.BlockTensorShapes(), "block " + std::to_string(i),
                                     m.dtype, m.alignment));
  }
  m.rest = LayoutSegment(m.config.RestTensorShapes(), "rest", m.dtype, m.alignment);
  return m;
}

uint64_t JobMemoryBudget(const StreamSpec& st, const c10::Device& device) {
  return JobMemoryBudget(st.gpu_memory_budget, st.budget_auto, device);
}

uint64_t JobMemoryBudget(uint64_t gpu_memory_budget, bool budget_auto, const c10::Device& device) {
  if (!budget_auto || !device.is_cuda()) return gpu_memory_budget;
#ifdef LORASTREAM_HAVE_CUDA
  const uint64_t free_bytes = CudaFreeBytes(device.has_index() ? device.index() : 0);
  const uint64_t budget = AutoMemoryBudget(free_bytes);
  LS_LOG_INFO("stream: gpu_memory_budget auto: {:.0f}% of the {} free on {}: {}",
              kAutoBudgetFraction * 100, FormatBytes(free_bytes), device.str(),
              FormatBytes(budget));
  return budget;
#else
  throw Error(ErrorCode::kUnsupported, "stream: " + device.str() + " in a build without CUDA");
#endif
}

StepCosts JobGroupCosts(const StepCosts& first, const std::vector<JobSpec>& others,
                        const BaseWeights& base, const c10::Device& device, c10::ScalarType dtype) {
  std::vector<StepCosts> jobs{first};
  for (const JobSpec& s : others) jobs.push_back(CalibratedStepCosts(s, base, device, dtype));
  return GroupStepCosts(jobs);
}

void RefuseGroupBeyondBudget(const MemoryModelInputs& inputs, uint64_t budget_bytes,
                             const std::string& first_name) {
  const std::string why = GroupBudgetRefusal(inputs, budget_bytes, first_name);
  if (!why.empty()) throw Error(ErrorCode::kRefused, why);
}

StreamPlanning PlanJobStream(const JobSpec& spec, const BaseWeights& base,
                             const MemoryModelInputs& inputs, const c10::Device& device,
                             c10::ScalarType dtype, const std::vector<JobSpec>& group) {
  StreamPlanning out;
  const StreamSpec& st = spec.stream;
  const uint64_t budget = JobMemoryBudget(st, device);
  out.budget = budget;
  if (budget == 0) {
    out.plan = PlanResidency(st.blocks_to_swap, 0, st.ring_size, inputs, st.forward_slots,
                             st.backward_slots, st.taped_blocks);
    return out;
  }
  if (!inputs.group.empty()) RefuseGroupBeyondBudget(inputs, budget, spec.name);
  // A budget: the cost model chooses among every plan that fits, from figures measured on
  // this device (cached per model, device and length).
  // A group's step takes every job's compute (measured per job) and the copies once.
  const StepCosts costs =
      JobGroupCosts(CalibratedStepCosts(spec, base, device, dtype), group, base, device, dtype);
  PlanChoice choice;
  try {
    choice = ChoosePlan(inputs, costs, budget);
  } catch (const Error& e) {
    if (!st.budget_auto || e.code() != ErrorCode::kRefused) throw;
    throw Error(ErrorCode::kRefused,
                "stream.gpu_memory_budget = \"auto\" is " + FormatBytes(budget) + " on " +
                    device.str() + " (" +
                    std::to_string(static_cast<int>(kAutoBudgetFraction * 100)) +
                    "% of its free memory), too little: " + e.what());
  }
  const CandidatePlan& chosen = choice.candidates[choice.chosen];
  LS_LOG_DEBUG("stream: candidate plans:\n{}", DescribeChoice(choice, budget));
  // Phase slots the job asks for explicitly override the choice (never below its ring).
  auto at_least_ring = [&](int64_t asked) {
    return asked > 0 ? std::max<int64_t>(asked, chosen.plan.ring_size) : asked;
  };
  out.plan = ApplyPhaseSlots(inputs, chosen.plan, budget, at_least_ring(st.forward_slots),
                             at_least_ring(st.backward_slots));
  out.plan = ApplyTapedBlocks(inputs, out.plan, budget, st.taped_blocks);
  // Per optimizer step, as the provider measures it (BeginStep to BeginStep).
  out.predicted_step_seconds = OptimizerStepSeconds(
      PredictStep(out.plan, inputs.block_bytes, costs, inputs.head_bytes).step_seconds, costs,
      spec.train.grad_accum);
  LS_LOG_INFO(
      "stream plan from gpu_memory_budget {} by the cost model ({} candidates; {}): "
      "{}; predicted {:.1f} ms per step (resident {:.1f} ms); estimate {}",
      FormatBytes(budget), choice.candidates.size(), costs.Describe(), out.plan.Describe(),
      out.predicted_step_seconds * 1e3,
      OptimizerStepSeconds(costs.ResidentStepSeconds(out.plan.num_blocks()), costs,
                           spec.train.grad_accum) *
          1e3,
      EstimateMemory(inputs, out.plan).Describe());
  return out;
}

}  // namespace lorastream::worker
