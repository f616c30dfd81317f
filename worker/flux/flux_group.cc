// The FLUX job group's training loop (worker/flux/flux_group.h); TrainFlux is a group of one.
#include "worker/flux/flux_group.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <thread>

#include <torch/csrc/autograd/autograd.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "common/acting_as.h"
#include "common/error.h"
#include "common/format_bytes.h"
#include "common/job_access.h"
#include "common/log.h"
#include "worker/flux/flux_adapter_io.h"
#include "worker/flux/flux_base.h"
#include "worker/flux/flux_calibrate.h"
#include "worker/flux/flux_checkpoint.h"
#include "worker/flux/flux_data.h"
#include "worker/flux/flux_model.h"
#include "worker/flux/flux_objective.h"
#include "worker/model/model.h"
#include "worker/model/torch_device.h"
#include "worker/train/adamw.h"
#include "worker/train/group_members.h"
#include "worker/train/stoppable_provider.h"

namespace lorastream::worker::flux {

namespace {

using Clock = std::chrono::steady_clock;

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

}  // namespace

JobSpec FluxJobSpec(const FluxJob& job, const std::string& name) {
  JobSpec spec;
  spec.name = name;
  spec.is_flux = true;
  spec.flux = job;
  MirrorFluxJob(spec);
  return spec;
}

// The group's base, engine and model.
struct FluxGroupTrainer::Shared {
  FluxGroupOptions options;
  JobSpec first;
  c10::Device device{c10::kCPU};
  c10::ScalarType dtype = at::kFloat;
  std::unique_ptr<FluxBase> base;
  std::shared_ptr<const FluxDataset> first_data;  // planned with; the first job's own
  // The engine, interrupted between two units when every job asks to stop.
  std::unique_ptr<StoppableProvider> provider;
  std::unique_ptr<FluxModel> model;
  int64_t streamed = 0;
  // From after the base is read: every file a job opens or creates is opened as the submitter.
  std::unique_ptr<ActingAs> as_submitter;
};

// One job of the group: its caches, adapter, optimizer, state, checkpoints and statistics.
class FluxGroupTrainer::Job {
 public:
  Job(GroupJob in, size_t index, Shared& group)
      : index_(index), name_(in.spec.name), in_(std::move(in)), group_(group) {
    const std::string refusal = GroupRefusal(group.first, in_.spec, group.options.device);
    if (!refusal.empty()) throw Error(ErrorCode::kRefused, refusal);
    job_ = in_.spec.flux;
    job_.singles_per_unit = group.base->singles_per_unit();  // a store's units are the store's
    const FluxConfig& config = group.base->config();
    ApplyFluxInitFrom(job_, config);
    lock_ = std::make_unique<OutputDirLock>(OutputDirLock::CreateAndAcquire(
        job_.output_dir, in_.lock_holder.empty() ? group.options.lock_holder : in_.lock_holder));
    data_ = job_.cache_dir == group.first.flux.cache_dir && group.first_data
                ? group.first_data
                : std::make_shared<const FluxDataset>(job_.cache_dir, config);
    adapter_ =
        std::make_unique<FluxAdapter>(config, FluxTargets(job_.targets, "flux.targets"), job_.rank,
                                      job_.alpha, MixSeed(job_.seed, 0xada7), group.device);
    LoadFluxInitFrom(job_, *adapter_);  // flux.init_from: its weights, a fresh optimizer
    AdamWOptions adam;
    adam.weight_decay = job_.weight_decay;
    optimizer_ = std::make_unique<AdamW>(adapter_->Params(), adam);
    sampling_ = {job_.timestep_sampling, job_.sigmoid_scale, job_.discrete_flow_shift};
    state_.seed = job_.seed;
    state_.fingerprint = FluxJobFingerprint(job_);
    if (group.options.resume) {
      const std::string from = FindFluxCheckpoint(job_.output_dir);
      if (!from.empty()) {
        state_ = LoadFluxCheckpoint(from, state_.fingerprint, *adapter_, *optimizer_);
        LS_LOG_INFO("job {}: resuming from {} (step {} of {})", name_, from, state_.step,
                    job_.steps);
        result_.checkpoint_dir = from;
        last_saved_ = state_.step;
      }
    }
    result_.start_step = state_.step;
    result_.steps_done = state_.step;
    LS_LOG_INFO(
        "job {}: FLUX: {} images in {} buckets, {} adapted modules (rank {}, alpha {}), {} of {} "
        "units streamed",
        name_, data_->size(), data_->buckets(), adapter_->modules().size(), job_.rank, job_.alpha,
        group.streamed, group.model->units().size());
  }

  size_t index() const { return index_; }
  const std::string& name() const { return name_; }
  bool done() const { return state_.step >= job_.steps; }
  bool StopRequested() const { return in_.should_stop && in_.should_stop(); }
  const TrainResult& result() const { return result_; }
  const FluxAdapter& adapter() const { return *adapter_; }
  const FluxBatch& batch() const { return input_.batch; }

  // Asked to stop at a step boundary: a checkpoint of its last step unless it has one.
  void Stop() {
    if (last_saved_ != state_.step && state_.step > 0) Save();
    result_.stopped = true;
    LS_LOG_INFO("job {}: stopped at step {}", name_, state_.step);
  }

  // Complete: its adapters were written at its last step (or by the run that trained it).
  void Complete() { result_.adapter_dir = job_.output_dir; }

  // The step's batch, noise and timesteps, from the job's seed and the step alone.
  void Begin() {
    lock_->RequireOwned();
    const int64_t step = state_.step;
    const c10::Device device = group_.device;
    const c10::ScalarType dtype = group_.dtype;
    const FluxDataBatch b = data_->Batch(step, job_.batch_size, job_.seed);
    const int64_t n = b.latents.size(0), h = b.latents.size(2), w = b.latents.size(3);
    at::Generator gen = at::detail::createCPUGenerator(MixSeed(job_.seed, 0x5eed, step));
    const at::Tensor noise = at::empty(b.latents.sizes(), at::kFloat).normal_(0.0, 1.0, gen);
    const at::Tensor t = SampleTimesteps(sampling_, n, h, w, gen);
    const FlowMatch fm = MakeFlowMatch(b.latents, noise, t);
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

  at::Tensor Loss(const at::Tensor& prediction) {
    return loss_ = FlowLoss(prediction, input_.target);
  }

  // After the group's backward: clipping and AdamW at the scheduled learning rate.
  void Update() {
    norm_ = ClipGradNormAsync(adapter_->Params(), job_.max_grad_norm);
    lr_ = job_.learning_rate *
          ScheduleFactor(job_.lr_schedule, state_.step, job_.warmup_steps, job_.steps);
    optimizer_->Step(lr_);
    optimizer_->ZeroGrad();
  }

  // Its step's figures on the device: the loss and the gradient norm (0 without clipping).
  at::Tensor Figures() const {
    const at::Tensor loss = loss_.detach().to(at::kFloat).reshape({1});
    return at::cat({loss, norm_.defined() ? norm_.to(at::kFloat).reshape({1})
                                          : at::zeros({1}, loss.options())});
  }

  // The step's figures (figures: its loss and gradient norm, read from the device; the group's
  // copies and the group step's time), its log line, on_step, and
  // its adapters and checkpoint when due. Returns true when the job leaves: complete, or
  // stopped (its checkpoint saved).
  bool Finish(const double* figures, const StepStats& group_stats, double seconds) {
    const int64_t step = state_.step;
    StepStats stats = group_stats;
    stats.step = step + 1;
    stats.total_steps = job_.steps;
    stats.loss = figures[0];
    stats.learning_rate = lr_;
    stats.grad_norm = figures[1];
    const int64_t n = input_.images, h = input_.height, w = input_.width;
    stats.tokens = n * (h / 2) * (w / 2);
    stats.step_seconds = seconds;
    stats.tokens_per_second = static_cast<double>(stats.tokens) / stats.step_seconds;
    if (!std::isfinite(stats.loss))
      throw Error(ErrorCode::kRefused, "FLUX step " + std::to_string(step + 1) +
                                           ": the loss is not finite (lower flux.learning_rate)");
    LS_LOG_INFO(
        "job {}: step {}/{} loss {:.6f} lr {:.3g} grad_norm {:.4f} {}x{} x{} {:.3f} s, H2D {} in "
        "{} copies ({} saved), peak {:.3f} GiB",
        name_, stats.step, job_.steps, stats.loss, lr_, stats.grad_norm, w * 8, h * 8, n,
        stats.step_seconds, FormatBytes(stats.h2d_bytes), stats.copies, stats.copies_saved,
        stats.peak_device_bytes / double(uint64_t{1} << 30));
    if (in_.on_step) in_.on_step(stats);
    lock_->RequireOwned();  // a later attempt of the job took the folder: nothing more is written
    const bool stop = StopRequested();
    const bool last = step + 1 == job_.steps;
    state_.step = step + 1;
    state_.samples_seen += n;
    result_.steps_done = state_.step;
    result_.final_loss = stats.loss;
    // The final adapters before the last checkpoint: a job killed between the two resumes
    // from an earlier checkpoint and writes them again, so a checkpoint at the last step
    // (after which a resume trains nothing) always has its adapters beside it.
    if (last) SaveFluxAdapters(*adapter_, group_.base->config(), job_.output_dir);
    if ((job_.save_every > 0 && state_.step % job_.save_every == 0) || last || stop) Save();
    if (last) Complete();
    if (stop && !last) {
      result_.stopped = true;
      LS_LOG_INFO("job {}: stopped at step {} (checkpoint saved)", name_, state_.step);
    }
    return last || stop;
  }

 private:
  void Save() {
    lock_->RequireOwned();
    result_.checkpoint_dir = SaveFluxCheckpoint(job_.output_dir, *adapter_, group_.base->config(),
                                                *optimizer_, state_, job_.keep_checkpoints);
    last_saved_ = state_.step;
  }

  size_t index_;
  std::string name_;
  GroupJob in_;  // its spec and callbacks
  Shared& group_;
  FluxJob job_;
  std::unique_ptr<OutputDirLock> lock_;  // released last (declared before what it guards)
  std::shared_ptr<const FluxDataset> data_;
  std::unique_ptr<FluxAdapter> adapter_;
  std::unique_ptr<AdamW> optimizer_;
  TimestepSampling sampling_;
  TrainerStateMeta state_;
  TrainResult result_;
  int64_t last_saved_ = -1;
  FluxStepInput input_;
  at::Tensor loss_, norm_;
  double lr_ = 0.0;
};

namespace {

// The other jobs a budget plans for (or, with `always`, a plan predicts for): each one's memory
// and measured costs at its own shape.
FluxPlanGroup PlanGroupOf(const FluxBase& base, const JobSpec& first,
                          const std::vector<JobSpec>& others, c10::Device device,
                          c10::ScalarType dtype, bool always = false) {
  FluxPlanGroup group;
  group.first_name = first.name;
  if (others.empty() || (!always && FluxJobBudget(first.flux, device) == 0)) return group;
  for (const JobSpec& spec : others) {
    FluxJob job = spec.flux;
    job.singles_per_unit = base.singles_per_unit();
    const FluxDataset data(job.cache_dir, base.config());
    const FluxMemoryInputs in = FluxMemoryInputsFor(base, job, data, device, dtype);
    group.members.push_back({spec.name, in.lora_params, in.batch, in.image_tokens, in.text_tokens});
    group.costs.push_back(MeasureFluxCosts(base, job, in, data, device, dtype));
  }
  return group;
}

}  // namespace

FluxGroupTrainer::FluxGroupTrainer(const JobSpec& first, const FluxGroupOptions& options)
    : shared_(std::make_unique<Shared>()) {
  Shared& g = *shared_;
  if (!first.is_flux)
    throw Error(ErrorCode::kRefused, "job " + first.name + " is not a FLUX.1 job ([flux])");
  g.options = options;
  g.first = first;
  at::set_num_threads(options.threads > 0 ? options.threads
                                          : static_cast<int>(std::thread::hardware_concurrency()));
  g.device = TorchDevice(ParseDevice(options.device));
  g.dtype = ComputeDtype(first.flux);
  {
    // A checkpoint is read as the job's submitter; a store is this worker's to attach.
    const ActingAs as(first.flux.store.empty() ? options.files_as : nullptr);
    g.base = std::make_unique<FluxBase>(FluxBase::ForJob(first.flux, g.dtype, g.device));
  }
  g.as_submitter = std::make_unique<ActingAs>(options.files_as);
  FluxJob planned = first.flux;
  ApplyFluxInitFrom(planned, g.base->config());
  planned.singles_per_unit = g.base->singles_per_unit();
  g.first_data = std::make_shared<const FluxDataset>(planned.cache_dir, g.base->config());
  const FluxPlanning planning = PlanFluxJob(
      *g.base, planned, *g.first_data, g.device, g.dtype,
      /*predict=*/false, PlanGroupOf(*g.base, first, options.plan_group, g.device, g.dtype));
  g.streamed = planning.plan.num_streamed();
  g.provider = std::make_unique<StoppableProvider>(
      g.base->MakeEngine(planning.plan, g.device, options.engine),
      [this] { return members_->AllStopRequested(); }, g.device.is_cuda());
  g.model = std::make_unique<FluxModel>(g.base->config(), g.base->rest(), g.provider.get(),
                                        planned.singles_per_unit, g.device, g.dtype);
  members_ = std::make_unique<GroupMembers<Job>>("FLUX group");
}

FluxGroupTrainer::~FluxGroupTrainer() {
  members_.reset();  // before the model they train through
}

size_t FluxGroupTrainer::size() const { return members_->size(); }

size_t FluxGroupTrainer::Add(GroupJob job) {
  const std::string name = job.spec.name;
  return members_->Add(
      name, [&](size_t index) { return std::make_unique<Job>(std::move(job), index, *shared_); });
}

std::vector<GroupJobOutcome> FluxGroupTrainer::TakeLeft() { return members_->TakeLeft(); }

bool FluxGroupTrainer::Step() {
  const auto t0 = Clock::now();
  // At the step boundary: jobs done or asked to stop leave; the others make their step's input.
  members_->Sweep([](Job& job) {
    if (job.done()) {
      job.Complete();
      return true;
    }
    if (job.StopRequested()) {
      job.Stop();
      return true;
    }
    job.Begin();
    return false;
  });
  const auto& jobs = members_->jobs();
  if (jobs.empty()) return false;

  // The shared work: one pass over the units for every job, one backward over their summed
  // losses, then each job's update. A failure here is the group's: every job leaves with it.
  StoppableProvider& provider = *shared_->provider;
  StepStats group_stats;
  at::Tensor host;
  try {
    std::vector<const FluxBatch*> batches;
    std::vector<const FluxAdapter*> adapters;
    for (const auto& job : jobs) {
      batches.push_back(&job->batch());
      adapters.push_back(&job->adapter());
    }
    provider.BeginStep();
    const std::vector<at::Tensor> predictions =
        shared_->model->ForwardGroup(batches, adapters, /*checkpointed=*/true);
    std::vector<at::Tensor> losses;
    for (size_t j = 0; j < jobs.size(); ++j) losses.push_back(jobs[j]->Loss(predictions[j]));
    // Each loss's gradient is 1, as its own backward would seed it.
    torch::autograd::backward(losses);
    provider.EndStep(group_stats);
    std::vector<at::Tensor> figures;
    for (const auto& job : jobs) {
      job->Update();
      figures.push_back(job->Figures());
    }
    // The step's one wait for the device, for every job's figures.
    host = at::cat(figures).to(at::kCPU).to(at::kDouble).contiguous();
  } catch (...) {
    if (provider.stopped()) {
      // Stopped between two units: the updates come after the backward, so each adapter and
      // optimizer is still that of its last completed step.
      members_->Sweep([](Job& job) {
        job.Stop();
        return true;
      });
      return false;
    }
    members_->LeaveAll(std::current_exception());
    return false;
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  const double* v = host.data_ptr<double>();
  members_->Sweep([&](Job& job) {
    const double* figures = v;
    v += 2;
    return job.Finish(figures, group_stats, seconds);
  });
  return !members_->empty();
}

void FluxGroupTrainer::Run() {
  while (!members_->empty()) Step();
}

std::vector<GroupJobOutcome> RunFluxGroupTraining(std::vector<GroupJob> jobs,
                                                  const FluxGroupOptions& options) {
  FluxGroupOptions group_options = options;
  if (group_options.plan_group.empty())  // the plan leaves room for every job given
    for (size_t j = 1; j < jobs.size(); ++j) group_options.plan_group.push_back(jobs[j].spec);
  return TrainAsGroup<FluxGroupTrainer>(std::move(jobs), group_options);
}

int RunFluxGroupPlanCommand(const std::vector<std::string>& job_paths,
                            const std::string& device_name) {
  std::vector<JobSpec> specs;
  for (const std::string& path : job_paths) {
    specs.push_back(LoadJobSpec(path));
    const std::string why = GroupRefusal(specs.front(), specs.back(), device_name);
    if (!why.empty()) throw Error(ErrorCode::kRefused, path + ": " + why);
  }
  at::set_num_threads(static_cast<int>(std::thread::hardware_concurrency()));
  const c10::Device device = TorchDevice(ParseDevice(device_name));
  FluxJob job = specs.front().flux;
  const c10::ScalarType dtype = ComputeDtype(job);
  const FluxBase base = FluxBase::ForJob(job, dtype, device);
  job.singles_per_unit = base.singles_per_unit();
  const FluxDataset data(job.cache_dir, base.config());
  const std::vector<JobSpec> others(specs.begin() + 1, specs.end());
  const FluxPlanning p =
      PlanFluxJob(base, job, data, device, dtype, /*predict=*/true,
                  PlanGroupOf(base, specs.front(), others, device, dtype, /*always=*/true));
  std::printf("a group of %zu FLUX jobs (%s and %zu more): every job's memory and compute\n%s",
              specs.size(), specs.front().name.c_str(), others.size(),
              DescribeFluxPlanning(p).c_str());
  return 0;
}

}  // namespace lorastream::worker::flux
