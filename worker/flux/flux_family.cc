// The FLUX.1 family's part of a group (worker/flux/flux_family.h).
#include "worker/flux/flux_family.h"

#include <cstdio>
#include <filesystem>
#include <tuple>

#include <ATen/ATen.h>

#include "common/base/error.h"
#include "common/base/format_bytes.h"
#include "common/base/log.h"
#include "common/formats/checkpoint_dir.h"
#include "common/posix/acting_as.h"
#include "common/posix/memory_limit.h"
#include "worker/flux/flux_adapter_io.h"
#include "worker/flux/flux_base.h"
#include "worker/flux/flux_calibrate.h"
#include "worker/flux/flux_checkpoint.h"
#include "worker/flux/flux_data.h"
#include "worker/flux/flux_group.h"
#include "worker/flux/flux_model.h"
#include "worker/flux/flux_objective.h"
#include "worker/model/model.h"
#include "worker/model/torch_device.h"
#include "worker/train/adamw.h"
#include "worker/train/dit_join.h"
#include "worker/train/graphed_call.h"
#include "worker/train/micro_batch_runner.h"
#include "worker/train/stoppable_provider.h"
#include "worker/train/stream_provider.h"

namespace lorastream::worker::flux {

namespace fs = std::filesystem;

namespace {

c10::ScalarType ComputeDtype(const FluxJob& job) {
  return job.dtype == "bf16" ? at::kBFloat16 : at::kFloat;
}

// A step's inputs on the device and its target (noise - latents, packed), made from the
// step's own seed.
struct FluxStepInput {
  FluxBatch batch;
  at::Tensor target;
  int64_t images = 0, height = 0, width = 0;  // the batch's latents: n x h x w
};

class Group final : public FamilyGroup {
 public:
  Group(const JobSpec& first, const TrainOptions& options, std::function<bool()> all_stop)
      : first_(first), files_as_(options.files_as) {
    device_ = TorchDevice(ParseDevice(options.device));
    dtype_ = ComputeDtype(first.flux);
    {
      // A checkpoint is read as the job's submitter; a store is this worker's to attach.
      const ActingAs as(first.flux.store.empty() ? options.files_as : nullptr);
      base_ = std::make_unique<FluxBase>(FluxBase::ForJob(first.flux, dtype_, device_));
    }
    FluxJob planned = first.flux;
    planned.singles_per_unit = base_->singles_per_unit();
    ApplyFluxInitFrom(planned, base_->config());  // lora.init_from's shape, before planning
    // The caches (this job's and, for the plan, the group's other jobs') are read as the
    // submitter.
    const ActingAs as(options.files_as);
    first_data_ = std::make_shared<const FluxDataset>(planned.cache_dir, base_->config());
    const FluxPlanning planning = PlanFluxJob(
        *base_, planned, *first_data_, device_, dtype_,
        /*predict=*/false, FluxPlanGroupOf(*base_, first, options.plan_group, device_, dtype_));
    streamed_ = planning.plan.num_streamed();
    // The memory the plan was made for, kept for the jobs that ask to join later; without a
    // budget, the group given (options.plan_group) is refused beyond the device's memory now,
    // naming the job, before anything is allocated.
    FluxMemoryInputs memory =
        planning.budget > 0 ? planning.inputs
                            : FluxMemoryInputsFor(*base_, planned, *first_data_, device_, dtype_);
    memory.group.clear();
    uint64_t limit = planning.budget;
    std::string limit_what = "the plan's budget (gpu_memory_budget)";
    if (planning.budget == 0) std::tie(limit, limit_what) = DeviceMemory(device_);
    admission_ = std::make_unique<DitJoinAdmission>(
        FluxJobMemoryModel(memory, planned), FluxDitJob(memory), planning.plan, limit, limit_what,
        [this](const JobSpec& spec) {
          return FluxMembersOf(*base_, {spec}, device_, dtype_).front();
        },
        files_as_);
    if (planning.budget == 0) {
      const uint64_t peak = EstimateFluxMemory(memory, planning.plan).total();
      if (limit > 0 && peak > limit)
        throw Error(ErrorCode::kRefused,
                    "job " + first.name + ": the estimated peak memory, " + FormatBytes(peak) +
                        " (its largest bucket: " + std::to_string(memory.image_tokens) +
                        " image tokens), exceeds the " + FormatBytes(limit) + " of " + limit_what +
                        ": lower train.batch_size or the caches' resolution, or stream units "
                        "(stream.gpu_memory_budget)");
      std::vector<JobSpec> others;
      for (const JobSpec& spec : options.plan_group) {
        others.push_back(spec);
        if (const std::string why = JoinRefusal(others); !why.empty())
          throw Error(ErrorCode::kRefused, why);
      }
    }
    provider_ = std::make_unique<StoppableProvider>(
        base_->MakeEngine(planning.plan, device_, options.engine), std::move(all_stop),
        device_.is_cuda());
    model_ = std::make_unique<FluxModel>(base_->config(), base_->rest(), provider_.get(),
                                         planned.singles_per_unit, device_, dtype_);
    model_->SetTapedUnits(TapedBlocks(planning.plan));
    // Every unit resident: the step's device work repeats, and one CUDA graph replays it.
    graphs_ = std::make_unique<GraphedStep>(device_.is_cuda() && CudaGraphsEnabled() &&
                                            provider_->step_is_host_only());
    LS_LOG_INFO("FLUX group: {}", planning.plan.Describe());
  }

  std::string log_name() const override { return "FLUX group"; }
  std::unique_ptr<FamilyJob> MakeJob(const JobSpec& spec) override;
  std::vector<std::string> CheckpointFiles() const override { return FluxCheckpointFiles(); }
  StoppableProvider& provider() override { return *provider_; }
  std::vector<std::vector<at::Tensor>> RunStep(const std::vector<FamilyJob*>& jobs) override;
  void MembersChanged() override { graphs_->Forget(); }
  void Release() override { graphs_->Forget(); }  // its graph accumulates into the jobs' tensors
  uint64_t captured_peak_bytes() const override { return graphs_->captured_peak_bytes(); }
  // Whether steps may replay a graph: the jobs then clear their gradients in place.
  bool graphs_steps() const { return graphs_->may_graph(); }
  std::string JoinRefusal(const std::vector<JobSpec>& others) const override {
    return admission_->JoinRefusal(others);
  }

  const FluxBase& base() const { return *base_; }
  FluxModel& model() { return *model_; }
  c10::Device device() const { return device_; }
  c10::ScalarType dtype() const { return dtype_; }
  int64_t streamed() const { return streamed_; }
  // The first job's caches when `cache_dir` is theirs (read once for the plan), else null.
  std::shared_ptr<const FluxDataset> data_of(const std::string& cache_dir) const {
    return cache_dir == first_.flux.cache_dir ? first_data_ : nullptr;
  }

 private:
  JobSpec first_;
  c10::Device device_{c10::kCPU};
  c10::ScalarType dtype_ = at::kFloat;
  std::unique_ptr<FluxBase> base_;
  std::shared_ptr<const FluxDataset> first_data_;  // planned with; the first job's own
  // The engine, interrupted between two units when every job asks to stop.
  std::unique_ptr<StoppableProvider> provider_;
  std::unique_ptr<FluxModel> model_;
  std::unique_ptr<GraphedStep> graphs_;
  int64_t streamed_ = 0;
  const UserIdentity* files_as_ = nullptr;
  // Joiners against the memory the plan was made for (the first job's) and its limit.
  std::unique_ptr<DitJoinAdmission> admission_;
};

// One job: its caches, its adapter, its step's inputs and loss.
class Job final : public FamilyJob {
 public:
  Job(const JobSpec& spec, Group& group) : name_(spec.name), job_(spec.flux), group_(group) {
    job_.singles_per_unit = group.base().singles_per_unit();  // a store's units are the store's
    const FluxConfig& config = group.base().config();
    ApplyFluxInitFrom(job_, config);  // lora.init_from: the file's rank, alpha and targets
    data_ = group.data_of(job_.cache_dir);
    if (!data_) data_ = std::make_shared<const FluxDataset>(job_.cache_dir, config);
    sampling_ = {job_.timestep_sampling, job_.sigmoid_scale, job_.discrete_flow_shift};
  }

  std::string Fingerprint() const override { return FluxJobFingerprint(job_); }
  void StartAdapter(const std::string& resume_dir) override {
    const FluxConfig& config = group_.base().config();
    adapter_ = std::make_unique<FluxAdapter>(
        config, FluxTargets(job_.targets, FluxKeyName(job_, "targets")), job_.rank, job_.alpha,
        MixSeed(job_.seed, 0xada7), group_.device(), FluxKeyName(job_, "rank"));
    if (!resume_dir.empty())
      LoadKohyaAdapter((fs::path(resume_dir) / kKohyaAdapterFile).string(), *adapter_);
    else
      LoadFluxInitFrom(job_, *adapter_);  // lora.init_from: its weights, a fresh optimizer
    LS_LOG_INFO(
        "job {}: FLUX: {} images in {} buckets, {} adapted modules (rank {}, alpha {}), {} of {} "
        "units streamed",
        name_, data_->size(), data_->buckets(), adapter_->modules().size(), job_.rank, job_.alpha,
        group_.streamed(), group_.model().units().size());
  }
  std::vector<at::Tensor> Params() const override { return adapter_->Params(); }
  std::vector<std::string> ParamNames() const override { return FluxParamNames(*adapter_); }
  void SaveAdapter(const std::string& dir) const override {
    SaveFluxAdapters(*adapter_, group_.base().config(), dir);
  }
  std::string DescribeDone(int64_t first_step, int64_t last_step, double loss,
                           double eval_loss) const override {
    char buf[160];
    std::snprintf(buf, sizeof buf, "done: steps %lld..%lld, final loss %.6f",
                  static_cast<long long>(first_step), static_cast<long long>(last_step), loss);
    const std::string dir = job_.output_dir;
    return std::string(buf) + "\nadapter (kohya, ComfyUI/Forge): " + dir + "/" + kKohyaAdapterFile +
           "\nadapter (diffusers load_lora_weights): " + dir + "/" + kDiffusersAdapterFile;
  }
  std::string learning_rate_key() const override { return FluxKeyName(job_, "learning_rate"); }

  int64_t total_steps() const override { return job_.steps; }
  // The step's batch, noise and timesteps, from the job's seed and the step alone.
  void Begin(int64_t step, int64_t samples_seen) override {
    const c10::Device device = group_.device();
    const c10::ScalarType dtype = group_.dtype();
    const FluxDataBatch b = data_->Batch(step, job_.batch_size, job_.seed);
    const int64_t n = b.latents.size(0), h = b.latents.size(2), w = b.latents.size(3);
    const dit::NoisedStep noised = dit::NoiseForStep(b.latents, job_.seed, step, sampling_);
    const FlowMatch& fm = noised.fm;
    const at::Tensor& t = noised.t;
    FluxStepInput in;
    in.batch.img = PackLatents(fm.noisy).to(device, dtype);
    in.batch.img_ids = ImageIds(n, h, w, device);
    in.batch.txt = b.t5.to(device, dtype);
    in.batch.txt_ids = b.txt_ids.to(device);
    in.batch.y = b.pooled.to(device, dtype);
    in.batch.timesteps = t.to(device);
    in.batch.guidance = at::full({n}, job_.guidance, at::TensorOptions(device).dtype(at::kFloat));
    in.target = PackLatents(fm.target).to(device);
    in.images = n;
    in.height = h;
    in.width = w;
    input_ = std::move(in);
  }
  int64_t step_samples() const override { return input_.images; }
  int64_t step_tokens() const override {
    return input_.images * (input_.height / 2) * (input_.width / 2);
  }
  void AfterUpdate(AdamW& optimizer, int64_t, int64_t) override {
    ClearGrads(optimizer, group_.graphs_steps());
  }
  int64_t graphed_micro_batches() const override { return graphed_steps_; }
  void CountGraphedStep() { ++graphed_steps_; }

  const FluxBatch& batch() const { return input_.batch; }
  const FluxAdapter& adapter() const { return *adapter_; }
  const at::Tensor& target() const { return input_.target; }

 private:
  std::string name_;
  FluxJob job_;
  Group& group_;
  std::shared_ptr<const FluxDataset> data_;
  std::unique_ptr<FluxAdapter> adapter_;
  TimestepSampling sampling_;
  FluxStepInput input_;
  int64_t graphed_steps_ = 0;
};

std::unique_ptr<FamilyJob> Group::MakeJob(const JobSpec& spec) {
  return std::make_unique<Job>(spec, *this);
}

std::vector<std::vector<at::Tensor>> Group::RunStep(const std::vector<FamilyJob*>& family_jobs) {
  // Per job its batch's tensors and its target, in this order: the step's inputs.
  constexpr size_t kPerJob = 8;
  std::vector<const FluxAdapter*> adapters;
  std::vector<at::Tensor> inputs;
  for (FamilyJob* j : family_jobs) {
    const Job& job = static_cast<const Job&>(*j);
    adapters.push_back(&job.adapter());
    const FluxBatch& b = job.batch();
    inputs.insert(inputs.end(),
                  {b.img, b.img_ids, b.txt, b.txt_ids, b.y, b.timesteps, b.guidance, job.target()});
  }
  const auto step = [&](const std::vector<at::Tensor>& in) {
    std::vector<FluxBatch> batches(adapters.size());
    std::vector<const FluxBatch*> batch_ptrs;
    std::vector<const at::Tensor*> targets;
    for (size_t j = 0; j < adapters.size(); ++j) {
      const at::Tensor* t = &in[kPerJob * j];
      batches[j] = {t[0], t[1], t[2], t[3], t[4], t[5], t[6]};
      batch_ptrs.push_back(&batches[j]);
      targets.push_back(&t[7]);
    }
    return dit::FlowLossesBackward(
        model_->ForwardGroup(batch_ptrs, adapters, /*checkpointed=*/true), targets);
  };
  // The shapes are the inputs' (the rotary table is computed from the ids on the device).
  bool graphed = false;
  std::vector<std::vector<at::Tensor>> losses =
      RunGroupStep(*graphs_, family_jobs, "", inputs, step, *provider_, "the FLUX step", &graphed);
  if (graphed)
    for (FamilyJob* j : family_jobs) static_cast<Job*>(j)->CountGraphedStep();
  return losses;
}

}  // namespace

bool Accepts(const JobSpec& spec) { return spec.is_flux; }

std::unique_ptr<FamilyGroup> MakeGroup(const JobSpec& first, const TrainOptions& options,
                                       std::function<bool()> all_stop) {
  return std::make_unique<Group>(first, options, std::move(all_stop));
}

}  // namespace lorastream::worker::flux
