// The job group's training loop (worker/train/group_trainer.h); RunTraining is a group of one.
#include "worker/train/group_trainer.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <thread>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "common/acting_as.h"
#include "common/durable_file.h"
#include "common/error.h"
#include "common/job_access.h"
#include "common/job_data.h"
#include "common/log.h"
#include "common/manifest_tokenizer.h"
#include "common/step_stats_json.h"
#include "common/tokenizer_id.h"
#include "common/unique_fd.h"
#include "worker/model/base_weights.h"
#include "worker/model/lm_head.h"
#include "worker/model/lora.h"
#include "worker/model/model.h"
#include "worker/stream/resident_provider.h"
#include "worker/train/adamw.h"
#include "worker/train/evaluate.h"
#include "worker/train/group_members.h"
#include "worker/train/micro_batch_runner.h"
#include "worker/train/stoppable_provider.h"
#include "worker/train/train_state.h"

namespace lorastream::worker {

namespace fs = std::filesystem;

namespace {

using Clock = std::chrono::steady_clock;

// The settings a resume must keep: changing any of them would silently train another job.
std::string Fingerprint(const JobSpec& s) {
  std::string f = "rank=" + std::to_string(s.lora.rank) + ";alpha=" + std::to_string(s.lora.alpha) +
                  ";rslora=" + std::to_string(s.lora.rslora) + ";targets=";
  for (const auto& t : s.lora.targets) f += t + ",";
  f += ";seed=" + std::to_string(s.train.seed) + ";batch=" + std::to_string(s.train.batch_size) +
       ";accum=" + std::to_string(s.train.grad_accum) +
       ";seq_len=" + std::to_string(s.data.seq_len) + ";packing=" + std::to_string(s.data.packing) +
       ";data=" + s.data.path;
  // A held-out split changes which documents are trained on (older fingerprints stay valid).
  if (s.eval.split > 0) f += ";eval_split=" + std::to_string(s.eval.split);
  return f;
}

// One write(2) per line, so that a full disk (or stats_file = "/dev/full") fails the job
// naming the file instead of losing the statistics in a stream's buffer.
void AppendStats(const std::string& path, const StepStats& s) {
  // Never through a link (one swapped in during the job leads nowhere); under ActingAs the
  // kernel checks this open against the job's submitter.
  UniqueFd fd(::open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644));
  if (!fd.valid()) ThrowErrno("train.stats_file: cannot append to " + path);
  const std::string line = StepStatsJson(s) + "\n";
  WriteAll(fd.get(), line.data(), line.size(), "train.stats_file " + path);
}

// The device and the compute dtype a job runs on.
struct ComputeTarget {
  c10::Device device{c10::kCPU};
  std::string dtype_name;  // "f32" | "bf16": train.dtype with "auto" resolved
  c10::ScalarType dtype = at::kFloat;
};

// Parses --device, refusing a CUDA device this build or machine lacks, and resolves
// train.dtype "auto" (bf16 on CUDA, f32 on the CPU).
ComputeTarget ChooseComputeTarget(const JobSpec& spec, const std::string& device_option) {
  ComputeTarget target;
  try {
    target.device = c10::Device(device_option == "cuda" ? std::string("cuda:0") : device_option);
  } catch (const std::exception&) {
    throw Error(ErrorCode::kInvalidArgument,
                "--device `" + device_option + "` is not a device (cpu, cuda, cuda:N)");
  }
  if (target.device.is_cuda() && !at::hasCUDA())
    throw Error(ErrorCode::kUnsupported,
                "--device " + device_option + ": this build or machine has no CUDA");
  target.dtype_name = spec.train.dtype;
  if (target.dtype_name == "auto") target.dtype_name = target.device.is_cuda() ? "bf16" : "f32";
  target.dtype = target.dtype_name == "bf16" ? at::kBFloat16 : at::kFloat;
  return target;
}

// Refusals before any work: the spec against the model, then the data against the tokenizer
// of a store's checkpoint (LoadJobData checks the tokens against the vocabulary).
void RefuseAgainstModel(const JobSpec& spec, const BaseWeights& base) {
  RequireValidJobSpec(spec, &base.config());
  if (const Manifest* manifest = base.manifest()) {  // a checkpoint's tokenizer: ValidateJobSpec
    const std::string why = DataTokenizerProblem(
        spec.data.path, spec.data.format, [&] { return ManifestTokenizer(*manifest); },
        "store `" + manifest->store_name + "`", base.config().vocab_size);
    if (!why.empty()) throw Error(ErrorCode::kRefused, why);
  }
}

// The model on its device. Members are destroyed in reverse order: the model before the
// providers it points at.
struct TrainModel {
  std::unique_ptr<BlockProvider> provider;
  StoppableProvider* stoppable = nullptr;       // `provider`
  std::unique_ptr<HeadProvider> resident_head;  // the head, when the provider does not stream it
  std::unique_ptr<CausalLm> model;
};

TrainModel BuildModel(const JobSpec& spec, const TrainOptions& options, const BaseWeights& base,
                      const ComputeTarget& target, std::function<bool()> should_stop) {
  const c10::Device device = target.device;
  TrainModel m;
  auto stoppable = std::make_unique<StoppableProvider>(
      options.make_provider
          ? options.make_provider(spec, base, device.str(), target.dtype_name, options.plan_group)
          : std::make_unique<ResidentProvider>(base, device, target.dtype),
      std::move(should_stop), device.is_cuda());
  m.stoppable = stoppable.get();
  m.provider = std::move(stoppable);
  // The LM head: the provider's when its plan streams it, else resident on the device.
  HeadProvider* head = m.provider->lm_head();
  if (head == nullptr) {
    m.resident_head = MakeResidentHead(base.rest(), device, target.dtype, options.head_slice_rows);
    head = m.resident_head.get();
  }
  RestWeights rest;
  // The embedding table stays in host RAM (the store's shared memory or the checkpoint's
  // mapping): each micro-batch's rows are gathered there and only they are copied.
  rest.embed_tokens = base.rest().embed_tokens;
  rest.packed_embed = base.rest().packed_embed;
  rest.norm = base.rest().norm.to(device, target.dtype);
  m.model =
      std::make_unique<CausalLm>(base.config(), rest, m.provider.get(), device, target.dtype, head);
  return m;
}

// Where training starts: a fresh adapter, or the latest checkpoint's adapter, AdamW moments
// and trainer state, refused when that checkpoint was written with other settings.
struct TrainStart {
  std::string resume_dir;  // "" when fresh
  std::unique_ptr<LoraAdapter> adapter;
  std::unique_ptr<AdamW> optimizer;
  TrainState state;
};

TrainStart StartOrResume(const JobSpec& spec, bool resume, const ModelConfig& config,
                         c10::Device device, const LoraSettings& settings,
                         const std::string& fingerprint) {
  TrainStart start;
  start.resume_dir = resume ? FindLatestCheckpoint(spec.train.output_dir) : "";
  const std::string& resume_dir = start.resume_dir;
  if (resume_dir.empty()) {
    // lora.init_from: the adapter's weights instead of peft's init, a fresh optimizer.
    start.adapter = std::make_unique<LoraAdapter>(
        spec.lora.init_from.empty()
            ? LoraAdapter::Init(config, settings, spec.train.seed, device)
            : LoraAdapter::InitFrom(spec.lora.init_from, config, settings, device));
  } else {
    start.adapter = std::make_unique<LoraAdapter>(LoraAdapter::Load(resume_dir, config, device));
    // The adapter file carries its settings; the job must still ask for the same ones.
    if (start.adapter->settings().TargetNames() != settings.TargetNames() ||
        start.adapter->settings().rank != settings.rank)
      throw Error(ErrorCode::kRefused,
                  "resume: " + resume_dir + " holds an adapter with other lora.rank/targets");
  }
  AdamWOptions adam_options{spec.optim.beta1, spec.optim.beta2, spec.optim.eps,
                            spec.optim.weight_decay};
  start.optimizer = std::make_unique<AdamW>(start.adapter->Params(), adam_options);
  start.state.seed = spec.train.seed;
  start.state.fingerprint = fingerprint;
  if (!resume_dir.empty()) {
    start.state = LoadTrainerState(resume_dir, *start.adapter, *start.optimizer);
    if (start.state.fingerprint != fingerprint)
      throw Error(ErrorCode::kRefused,
                  "resume: " + resume_dir + " was written by a job with other settings (" +
                      start.state.fingerprint + "); now: " + fingerprint +
                      ". Use another train.output_dir or restore the settings.");
    LS_LOG_INFO("job {}: resuming from {} (step {})", spec.name, resume_dir, start.state.step);
  }
  return start;
}

// A micro-batch on the device: its embeddings (gathered where the table is) and its targets,
// on CUDA through pinned memory, so that issuing the copies does not wait for the device's
// queue (a copy from pageable memory would).
struct MicroBatchInput {
  at::Tensor embeddings, targets;
};

MicroBatchInput MicroBatchOnDevice(CausalLm& model, const Batch& b, c10::Device device) {
  MicroBatchInput in;
  in.embeddings = model.Embed(ToDeviceLong(b.ids, b.rows, b.seq_len, at::kCPU));
  const at::Tensor t = ToDeviceLong(b.targets, b.rows, b.seq_len, at::kCPU);
  in.targets = device.is_cuda()
                   ? t.pin_memory().to(at::TensorOptions().device(device), /*non_blocking=*/true)
                   : t.to(device);
  return in;
}

// A step's micro-batches, the first one's embeddings and targets already issued to the
// device: the trainer makes step n+1's while the device still runs step n's tail, so that
// the host's gather does not leave the device idle between steps.
struct StepInput {
  int64_t position = -1;  // the sample position it was made for (-1: none)
  std::vector<Batch> batches;
  int64_t n_targets = 0;
  MicroBatchInput first;  // micro-batch 0's, on the device
};

StepInput PrepareStep(const JobSpec& spec, const SequenceSet& sequences, Sampler& sampler,
                      CausalLm& model, int64_t position, c10::Device device) {
  const int64_t rows = spec.train.batch_size, accum = spec.train.grad_accum;
  StepInput in;
  in.position = position;
  for (int64_t m = 0; m < accum; ++m) {
    in.batches.push_back(MakeBatch(sequences, sampler, position + m * rows, rows));
    in.n_targets += in.batches.back().n_targets;
  }
  in.first = MicroBatchOnDevice(model, in.batches.front(), device);
  return in;
}

// The step's figures: its number, tokens and throughput.
void SetStepFigures(int64_t step, int64_t total, int64_t tokens, double seconds, StepStats* stats) {
  stats->step = step;
  stats->total_steps = total;
  stats->tokens = tokens;
  stats->step_seconds = seconds;
  stats->tokens_per_second = seconds > 0 ? static_cast<double>(tokens) / seconds : 0.0;
}

// Evaluation: every eval.every steps, at every checkpoint step (so that each checkpoint
// records its eval loss for train.keep_best) and at the end. Sets state->eval_loss (NaN when
// this step does not evaluate) and the step's eval figures; returns whether it evaluated.
bool EvaluateIfDue(const JobSpec& spec, const JobData& data, CausalLm& model,
                   const LoraAdapter& adapter, bool checkpoint_now, TrainState* state,
                   StepStats* stats) {
  state->eval_loss = std::numeric_limits<double>::quiet_NaN();
  if (!(data.eval.count > 0 &&
        (checkpoint_now || (spec.eval.every > 0 && state->step % spec.eval.every == 0))))
    return false;
  const EvalResult eval =
      Evaluate(model, adapter, data.eval, spec.train.batch_size, spec.eval.batches);
  stats->eval_loss = eval.loss;
  stats->eval_tokens = eval.tokens;
  state->eval_loss = eval.loss;
  return true;
}

// The figures a step reads from the device: each micro-batch's loss, then the gradient norm.
at::Tensor GradNormFigure(const at::Tensor& norm, const at::Tensor& like) {
  return norm.defined() ? norm.to(at::kFloat).reshape({}) : at::zeros({}, like.options());
}

}  // namespace

// The group's base, provider and model.
struct GroupTrainer::Shared {
  TrainOptions options;
  JobSpec first;  // resolved
  ComputeTarget target;
  std::unique_ptr<BaseWeights> base;
  TrainModel m;
  // From after the model is built: every file a job opens or creates is opened as the
  // submitter (TrainOptions::files_as; a store is the worker's own to attach).
  std::unique_ptr<ActingAs> as_submitter;
  // The micro-batches of two or more jobs (a group of one runs through its job's runner).
  std::unique_ptr<GroupMicroBatchRunner> group_runner;
};

// One job of the group: its data, adapter, optimizer, state, checkpoints and statistics.
class GroupTrainer::Job {
 public:
  Job(GroupJob job, size_t index, Shared& group)
      : index_(index), spec_(std::move(job.spec)), in_(std::move(job)), group_(group) {
    ResolveJobSpec(spec_);
    ApplyInitFrom(spec_.lora);
    const std::string refusal = GroupRefusal(group.first, spec_, group.options.device);
    if (!refusal.empty()) throw Error(ErrorCode::kRefused, refusal);
    const BaseWeights& base = *group.base;
    RefuseAgainstModel(spec_, base);
    const ModelConfig& config = base.config();
    data_ = LoadJobData(spec_, config.vocab_size);
    LS_LOG_INFO("job {}: {}", spec_.name, DescribeJobData(spec_, data_));
    const std::string fingerprint = Fingerprint(spec_);
    const LoraSettings settings = LoraSettingsFromSpec(spec_.lora);
    lock_ = std::make_unique<OutputDirLock>(OutputDirLock::CreateAndAcquire(
        spec_.train.output_dir,
        in_.lock_holder.empty() ? group.options.lock_holder : in_.lock_holder));
    start_ = StartOrResume(spec_, group.options.resume, config, group.target.device, settings,
                           fingerprint);
    result_.start_step = start_.state.step;
    result_.steps_done = start_.state.step;
    result_.checkpoint_dir = start_.resume_dir;
    last_saved_ = start_.resume_dir.empty() ? -1 : start_.state.step;
    total_ = data_.steps;
    stats_path_ = spec_.train.stats_file.empty()
                      ? (fs::path(spec_.train.output_dir) / "stats.jsonl").string()
                      : spec_.train.stats_file;
    DropStatsAfter(stats_path_, start_.state.step);  // steps an interrupted run wrote after it
    sampler_ = std::make_unique<Sampler>(data_.train.count, spec_.train.seed);
    params_ = start_.adapter->Params();
    runner_ = std::make_unique<MicroBatchRunner>(*group.m.model, *start_.adapter,
                                                 /*allow_graphs=*/true);
  }

  size_t index() const { return index_; }
  const std::string& name() const { return spec_.name; }
  bool done() const { return start_.state.step >= total_; }
  bool StopRequested() const { return in_.should_stop && in_.should_stop(); }
  int64_t micro_batches() const { return spec_.train.grad_accum; }
  const TrainResult& result() const { return result_; }

  // A checkpoint unless the current step has one; the job leaves stopped.
  void Stop(const char* where = "at") {
    if (last_saved_ != start_.state.step) Save();
    result_.stopped = true;
    LS_LOG_INFO("job {}: stopped {} step {} (checkpoint saved)", spec_.name, where,
                start_.state.step);
  }

  // The end: the last checkpoint and the final adapter.
  void Complete() {
    if (last_saved_ != start_.state.step) Save();
    lock_->RequireOwned();
    start_.adapter->Save(spec_.train.output_dir, group_.base->name_or_path());
    result_.adapter_dir = spec_.train.output_dir;
  }

  // The step's start: its learning rate, its input (made now unless the step before made it)
  // and its loss divisor.
  void Begin() {
    // Every write of the job first makes sure that the folder is still this attempt's: a
    // later attempt that took it over (this one was declared dead, paused say) fences it.
    lock_->RequireOwned();
    CausalLm& model = *group_.m.model;
    lr_ = spec_.optim.lr *
          ScheduleFactor(spec_.optim.schedule, start_.state.step, spec_.optim.warmup_steps, total_);
    if (input_.position != start_.state.samples_seen)
      input_ = PrepareStep(spec_, data_.train, *sampler_, model, start_.state.samples_seen,
                           group_.target.device);
    divisor_ = model.LossDivisor(input_.n_targets);
    figures_.clear();
  }

  // Micro-batch m's part of a group micro-batch.
  GroupMicroBatch MicroBatch(int64_t m) {
    const MicroBatchInput mb =
        m == 0 ? input_.first
               : MicroBatchOnDevice(*group_.m.model, input_.batches[m], group_.target.device);
    return GroupMicroBatch{
        mb.embeddings, mb.targets, divisor_, start_.adapter.get(),
        MixSeed(spec_.train.seed, 0xd209, static_cast<uint64_t>(start_.state.step),
                static_cast<uint64_t>(m))};
  }

  // Micro-batch m alone (a group of one): through the runner, a CUDA graph where it may.
  void RunAlone(int64_t m) {
    const GroupMicroBatch mb = MicroBatch(m);
    AddLoss(runner_->Run(mb.embeddings, mb.targets, mb.loss_divisor, mb.dropout_seed));
  }

  void AddLoss(const at::Tensor& loss) { figures_.push_back(loss.to(at::kFloat).reshape({})); }

  // Its micro-batch ran in a group's CUDA graph, which accumulates into its gradients.
  void CountGroupReplay() {
    runner_->KeepGradsInPlace();
    ++group_replays_;
  }

  // After its micro-batches: clipping, AdamW, the gradients cleared, the next step's input
  // issued; the gradient norm joins the step's figures.
  void Update() {
    const at::Tensor norm = ClipGradNormAsync(params_, spec_.optim.grad_clip);
    figures_.push_back(GradNormFigure(norm, figures_.front()));
    start_.optimizer->Step(lr_);
    runner_->ZeroGrad(*start_.optimizer);
    next_ = start_.state.samples_seen + spec_.train.batch_size * spec_.train.grad_accum;
    input_ = start_.state.step + 1 < total_
                 ? PrepareStep(spec_, data_.train, *sampler_, *group_.m.model, next_,
                               group_.target.device)
                 : StepInput{};
  }

  const std::vector<at::Tensor>& figures() const { return figures_; }

  // The step's end, from its figures read from the device (v: each micro-batch's loss, then
  // the gradient norm) and the group's copy statistics: a non-finite loss fails the job (the
  // adapter in memory is then lost; checkpoints are written only after a step's loss is
  // read); else the state advances, and evaluation, statistics and checkpoints follow.
  void Finish(const double* v, const StepStats& group_stats, double seconds) {
    const int64_t accum = spec_.train.grad_accum;
    TrainState& state = start_.state;
    StepStats stats = group_stats;
    // A replay allocates nothing: its memory is what the captured micro-batch allocated.
    stats.peak_device_bytes =
        std::max({stats.peak_device_bytes, runner_->captured_peak_bytes(),
                  group_.group_runner ? group_.group_runner->captured_peak_bytes() : uint64_t{0}});
    double loss_value = 0.0;
    for (int64_t m = 0; m < accum; ++m) loss_value += v[m];
    if (!std::isfinite(loss_value))
      throw Error(ErrorCode::kInternal, "job " + spec_.name + ": the loss is " +
                                            std::to_string(loss_value) + " at step " +
                                            std::to_string(state.step + 1) +
                                            " (lower optim.lr or check the data)");
    stats.grad_norm = v[accum];
    state.step += 1;
    state.samples_seen = next_;
    stats.loss = loss_value;
    stats.learning_rate = lr_;
    SetStepFigures(state.step, total_, spec_.train.batch_size * accum * data_.train.seq_len,
                   seconds, &stats);
    const bool checkpoint_now =
        state.step == total_ ||
        (spec_.train.checkpoint_every > 0 && state.step % spec_.train.checkpoint_every == 0);
    if (EvaluateIfDue(spec_, data_, *group_.m.model, *start_.adapter, checkpoint_now, &state,
                      &stats))
      result_.final_eval_loss = stats.eval_loss;
    lock_->RequireOwned();
    AppendStats(stats_path_, stats);
    result_.steps_done = state.step;
    result_.final_loss = stats.loss;
    result_.graphed_micro_batches = runner_->replays() + group_replays_;
    if (in_.on_step) in_.on_step(stats);
    if (checkpoint_now && state.step < total_) Save();
  }

 private:
  void Save() {
    lock_->RequireOwned();
    result_.checkpoint_dir = SaveCheckpoint(
        spec_.train.output_dir, *start_.adapter, *start_.optimizer, start_.state,
        group_.base->name_or_path(), {spec_.train.keep_checkpoints, spec_.train.keep_best});
    last_saved_ = start_.state.step;
  }

  size_t index_;
  JobSpec spec_;
  GroupJob in_;  // its callbacks
  Shared& group_;
  JobData data_;
  std::unique_ptr<OutputDirLock> lock_;  // released last (declared before what it guards)
  TrainStart start_;
  std::unique_ptr<Sampler> sampler_;
  std::vector<at::Tensor> params_;
  std::unique_ptr<MicroBatchRunner> runner_;
  TrainResult result_;
  int64_t total_ = 0;
  int64_t last_saved_ = -1;
  std::string stats_path_;
  StepInput input_;  // the next step's, made while the device runs the step before
  double lr_ = 0.0;
  at::Tensor divisor_;
  std::vector<at::Tensor> figures_;
  int64_t next_ = 0;           // samples_seen after this step
  int64_t group_replays_ = 0;  // micro-batches run in a group's CUDA graph
};

GroupTrainer::GroupTrainer(const JobSpec& first, const TrainOptions& options)
    : shared_(std::make_unique<Shared>()) {
  Shared& g = *shared_;
  g.options = options;
  g.first = first;
  ResolveJobSpec(g.first);
  ApplyInitFrom(g.first.lora);
  at::set_num_threads(options.threads > 0 ? options.threads
                                          : static_cast<int>(std::thread::hardware_concurrency()));
  g.target = ChooseComputeTarget(g.first, options.device);
  {
    // A model folder is read as the job's submitter; a store is this worker's to attach.
    const ActingAs as(g.first.model.checkpoint.empty() ? nullptr : options.files_as);
    g.base = std::make_unique<BaseWeights>(BaseWeights::ForJob(g.first));
  }
  RefuseAgainstModel(g.first, *g.base);
  const ModelConfig& config = g.base->config();
  LS_LOG_INFO("group of {}: {} {} layers, device {}, dtype {}", g.first.name, config.model_type,
              config.num_hidden_layers, g.target.device.str(), g.target.dtype_name);
  // A stop asked by every job of the group ends a step between two blocks.
  g.m = BuildModel(g.first, options, *g.base, g.target,
                   [this] { return members_->AllStopRequested(); });
  g.group_runner = std::make_unique<GroupMicroBatchRunner>(*g.m.model);
  g.as_submitter = std::make_unique<ActingAs>(options.files_as);
  // Every change of composition: the group's graphs read the jobs' tensors.
  members_ = std::make_unique<GroupMembers<Job>>(
      "group", [runner = g.group_runner.get()] { runner->Forget(); });
}

GroupTrainer::~GroupTrainer() {
  shared_->group_runner.reset();  // its graphs accumulate into the jobs' gradients
  members_.reset();               // before the model they train through
}

size_t GroupTrainer::size() const { return members_->size(); }

size_t GroupTrainer::Add(GroupJob job) {
  const std::string name = job.spec.name;
  return members_->Add(
      name, [&](size_t index) { return std::make_unique<Job>(std::move(job), index, *shared_); });
}

std::vector<GroupJobOutcome> GroupTrainer::TakeLeft() { return members_->TakeLeft(); }

bool GroupTrainer::Step() {
  // At the step boundary: jobs done or asked to stop leave; the others begin their step.
  members_->Sweep([](Job& job) {
    if (job.done()) {
      job.Complete();
      return true;
    }
    if (job.StopRequested()) {
      job.Stop();
      return true;
    }
    return false;
  });
  const auto t0 = Clock::now();
  members_->Sweep([](Job& job) {
    job.Begin();
    return false;
  });
  const auto& jobs = members_->jobs();
  if (jobs.empty()) return false;

  // The shared work: every job's micro-batches, then their updates. A failure here is the
  // group's: every job leaves with it.
  BlockProvider& provider = *shared_->m.provider;
  at::Tensor host;
  try {
    provider.BeginStep();
    int64_t micro_batches = 0;
    for (const auto& job : jobs) micro_batches = std::max(micro_batches, job->micro_batches());
    for (int64_t m = 0; m < micro_batches; ++m) {
      if (jobs.size() == 1) {
        jobs[0]->RunAlone(m);
        continue;
      }
      std::vector<Job*> in;
      std::vector<size_t> indices;
      std::vector<GroupMicroBatch> parts;
      for (const auto& job : jobs) {
        if (m >= job->micro_batches()) continue;  // its step has fewer micro-batches
        in.push_back(job.get());
        indices.push_back(job->index());
        parts.push_back(job->MicroBatch(m));
      }
      bool graphed = false;
      const std::vector<at::Tensor> losses = shared_->group_runner->Run(parts, indices, &graphed);
      for (size_t j = 0; j < in.size(); ++j) {
        in[j]->AddLoss(losses[j]);
        if (graphed) in[j]->CountGroupReplay();
      }
    }
    std::vector<at::Tensor> figures;
    for (const auto& job : jobs) {
      job->Update();
      figures.insert(figures.end(), job->figures().begin(), job->figures().end());
    }
    // The step's one wait for the device, for every job's figures.
    host = at::stack(figures).to(at::kCPU).to(at::kDouble).contiguous();
  } catch (...) {
    const std::exception_ptr error = std::current_exception();
    if (shared_->m.stoppable->stopped()) {
      // Stopped between two blocks. Updates come after every micro-batch, so each adapter
      // and optimizer is still that of its last completed step.
      members_->Sweep([](Job& job) {
        job.Stop("inside");
        return true;
      });
      return false;
    }
    members_->LeaveAll(error);
    return false;
  }
  StepStats group_stats;
  provider.EndStep(group_stats);
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  // Each job's figures, in the group's order (a job that leaves is erased: the next takes its
  // position).
  const double* v = host.data_ptr<double>();
  members_->Sweep([&](Job& job) {
    const double* figures = v;
    v += job.micro_batches() + 1;
    job.Finish(figures, group_stats, seconds);
    if (!job.done()) return false;
    job.Complete();
    return true;
  });
  return !members_->empty();
}

void GroupTrainer::Run() {
  while (!members_->empty()) Step();
}

std::vector<GroupJobOutcome> RunGroupTraining(std::vector<GroupJob> jobs,
                                              const TrainOptions& options) {
  TrainOptions group_options = options;
  if (group_options.plan_group.empty())  // the plan leaves room for every job given
    for (size_t j = 1; j < jobs.size(); ++j) group_options.plan_group.push_back(jobs[j].spec);
  return TrainAsGroup<GroupTrainer>(std::move(jobs), group_options);
}

}  // namespace lorastream::worker
