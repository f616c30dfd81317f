#include "worker/trainer.h"

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <thread>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>

#include "common/acting_as.h"
#include "common/durable_file.h"
#include "common/error.h"
#include "common/format_bytes.h"
#include "common/job_access.h"
#include "common/job_data.h"
#include "common/log.h"
#include "common/manifest_tokenizer.h"
#include "common/step_stats_json.h"
#include "common/tokenizer_id.h"
#include "common/unique_fd.h"
#include "worker/adamw.h"
#include "worker/base_weights.h"
#include "worker/evaluate.h"
#include "worker/lm_head.h"
#include "worker/lora.h"
#include "worker/micro_batch_runner.h"
#include "worker/model.h"
#include "worker/resident_provider.h"
#include "worker/stream_budget.h"
#include "worker/train_state.h"

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

// The job's provider, asking should_stop before every block it hands out: a stop (cancel,
// SIGTERM) asked in the middle of a long step ends it at the next block, within seconds,
// instead of after the step. Acquire then throws; stopped() tells the trainer why the step
// failed. A step captured as a CUDA graph (host-only acquisition on a GPU) is never
// interrupted mid-capture: it stops at the step boundary.
class StoppableProvider final : public BlockProvider {
 public:
  StoppableProvider(std::unique_ptr<BlockProvider> inner, std::function<bool()> should_stop,
                    bool cuda)
      : inner_(std::move(inner)),
        should_stop_(std::move(should_stop)),
        poll_(should_stop_ && !(cuda && inner_->step_is_host_only())) {}
  int num_blocks() const override { return inner_->num_blocks(); }
  void BeginStep() override { inner_->BeginStep(); }
  const BlockWeights& Acquire(int block) override {
    if (poll_ && should_stop_()) {
      stopped_ = true;
      throw Error(ErrorCode::kCancelled, "stopped before block " + std::to_string(block));
    }
    return inner_->Acquire(block);
  }
  void Release(int block) override { inner_->Release(block); }
  void EndStep(StepStats& stats) override { inner_->EndStep(stats); }
  HeadProvider* lm_head() override { return inner_->lm_head(); }
  int taped_blocks() const override { return inner_->taped_blocks(); }
  bool step_is_host_only() const override { return inner_->step_is_host_only(); }
  bool stopped() const { return stopped_; }

 private:
  std::unique_ptr<BlockProvider> inner_;
  std::function<bool()> should_stop_;
  const bool poll_;
  bool stopped_ = false;
};

// The model on its device. Members are destroyed in reverse order: the model before the
// providers it points at.
struct TrainModel {
  std::unique_ptr<BlockProvider> provider;
  StoppableProvider* stoppable = nullptr;       // `provider`
  std::unique_ptr<HeadProvider> resident_head;  // the head, when the provider does not stream it
  std::unique_ptr<CausalLm> model;
};

TrainModel BuildModel(const JobSpec& spec, const TrainOptions& options, const BaseWeights& base,
                      const ComputeTarget& target, const std::function<bool()>& should_stop) {
  const c10::Device device = target.device;
  TrainModel m;
  auto stoppable = std::make_unique<StoppableProvider>(
      options.make_provider ? options.make_provider(spec, base, device.str(), target.dtype_name)
                            : std::make_unique<ResidentProvider>(base, device, target.dtype),
      should_stop, device.is_cuda());
  m.stoppable = stoppable.get();
  m.provider = std::move(stoppable);
  // The LM head: the provider's when its plan streams it, else resident on the device.
  HeadProvider* head = m.provider->lm_head();
  if (head == nullptr) {
    m.resident_head = MakeResidentHead(base.rest().lm_head, device, target.dtype);
    head = m.resident_head.get();
  }
  RestWeights rest;
  // The embedding table stays in host RAM (the store's shared memory or the checkpoint's
  // mapping): each micro-batch's rows are gathered there and only they are copied.
  rest.embed_tokens = base.rest().embed_tokens;
  rest.norm = base.rest().norm.to(device, target.dtype);
  m.model =
      std::make_unique<CausalLm>(base.config(), rest, m.provider.get(), device, target.dtype, head);
  return m;
}

// One job trains into a folder at a time, from before it looks for a checkpoint to resume
// until it returns (common/job_access.h).
OutputDirLock LockOutputDir(const JobSpec& spec, const TrainOptions& options) {
  std::error_code dir_error;
  fs::create_directories(spec.train.output_dir, dir_error);
  if (dir_error)
    throw Error(ErrorCode::kIo, "train.output_dir: cannot create " + spec.train.output_dir + ": " +
                                    dir_error.message());
  return OutputDirLock::Acquire(spec.train.output_dir,
                                options.lock_holder.empty()
                                    ? "lorastream-worker pid " + std::to_string(::getpid())
                                    : options.lock_holder);
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
    start.adapter =
        std::make_unique<LoraAdapter>(LoraAdapter::Init(config, settings, spec.train.seed, device));
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

// One optimizer step at learning rate `lr`: grad_accum micro-batches of batch_size sequences,
// each a checkpointed forward and backward whose loss is divided by the step's target-token
// count; then clipping and AdamW, and `state` advanced. `input` holds the step's input when it
// was prepared for it; when `prepare_next`, it receives the next step's, issued before the
// step's one wait for the device (its loss and gradient norm). Sets the step's loss, grad
// norm and the provider's copy statistics in *stats. A non-finite loss fails the step after
// the update (the adapter in memory is then lost; checkpoints are written only after a
// step's loss is read).
void TrainStep(const JobSpec& spec, const SequenceSet& sequences, Sampler& sampler, CausalLm& model,
               BlockProvider& provider, MicroBatchRunner& runner, AdamW& optimizer,
               const std::vector<at::Tensor>& params, double lr, c10::Device device,
               bool prepare_next, StepInput* input, TrainState* state, StepStats* stats) {
  const int64_t rows = spec.train.batch_size, accum = spec.train.grad_accum;
  if (input->position != state->samples_seen)
    *input = PrepareStep(spec, sequences, sampler, model, state->samples_seen, device);
  const at::Tensor divisor = model.LossDivisor(input->n_targets);
  provider.BeginStep();
  std::vector<at::Tensor> figures;  // each micro-batch's loss, then the gradient norm
  for (int64_t m = 0; m < accum; ++m) {
    const MicroBatchInput mb =
        m == 0 ? input->first : MicroBatchOnDevice(model, input->batches[m], device);
    figures.push_back(runner
                          .Run(mb.embeddings, mb.targets, divisor,
                               MixSeed(spec.train.seed, 0xd209, static_cast<uint64_t>(state->step),
                                       static_cast<uint64_t>(m)))
                          .to(at::kFloat)
                          .reshape({}));
  }
  const at::Tensor norm = ClipGradNormAsync(params, spec.optim.grad_clip);
  figures.push_back(norm.defined() ? norm.to(at::kFloat).reshape({})
                                   : at::zeros({}, figures.front().options()));
  optimizer.Step(lr);
  runner.ZeroGrad(optimizer);
  const int64_t next = state->samples_seen + rows * accum;
  *input = prepare_next ? PrepareStep(spec, sequences, sampler, model, next, device) : StepInput{};
  // The step's one wait for the device.
  const at::Tensor host = at::stack(figures).to(at::kCPU).to(at::kDouble).contiguous();
  const double* v = host.data_ptr<double>();
  double loss_value = 0.0;
  for (int64_t m = 0; m < accum; ++m) loss_value += v[m];
  provider.EndStep(*stats);
  // A replay allocates nothing: its memory is what the captured micro-batch allocated.
  stats->peak_device_bytes = std::max(stats->peak_device_bytes, runner.captured_peak_bytes());
  if (!std::isfinite(loss_value))
    throw Error(ErrorCode::kInternal,
                "job " + spec.name + ": the loss is " + std::to_string(loss_value) + " at step " +
                    std::to_string(state->step + 1) + " (lower optim.lr or check the data)");
  stats->grad_norm = v[accum];
  state->step += 1;
  state->samples_seen = next;
  stats->loss = loss_value;
  stats->learning_rate = lr;
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

}  // namespace

std::string FormatProgress(const StepStats& s, double eta) {
  char buf[256];
  const int64_t e = static_cast<int64_t>(std::max(0.0, eta) + 0.5);
  char eta_text[32];
  if (e >= 3600)
    std::snprintf(eta_text, sizeof eta_text, "%lldh%02lldm", static_cast<long long>(e / 3600),
                  static_cast<long long>(e / 60 % 60));
  else
    std::snprintf(eta_text, sizeof eta_text, "%lldm%02llds", static_cast<long long>(e / 60),
                  static_cast<long long>(e % 60));
  std::snprintf(buf, sizeof buf, "step %lld/%lld loss %.4f lr %.2e gnorm %.3f tok/s %.0f eta %s",
                static_cast<long long>(s.step), static_cast<long long>(s.total_steps), s.loss,
                s.learning_rate, s.grad_norm, s.tokens_per_second, eta_text);
  std::string line = buf;
  if (s.h2d_bytes > 0 || s.copies > 0) {
    std::snprintf(buf, sizeof buf, " h2d %.2fGB stall %.1fms copies %lld (+%lld reused)",
                  static_cast<double>(s.h2d_bytes) / 1e9, s.stall_seconds * 1e3,
                  static_cast<long long>(s.copies), static_cast<long long>(s.copies_saved));
    line += buf;
  }
  if (s.peak_device_bytes > 0) line += " peak " + FormatBytes(s.peak_device_bytes, 2);
  if (s.has_eval()) {
    std::snprintf(buf, sizeof buf, " eval %.4f", s.eval_loss);
    line += buf;
  }
  return line;
}

TrainResult RunTraining(const JobSpec& spec_in, const TrainOptions& options,
                        const std::function<void(const StepStats&)>& on_step,
                        const std::function<bool()>& should_stop) {
  JobSpec spec = spec_in;
  ResolveJobSpec(spec);
  at::set_num_threads(options.threads > 0 ? options.threads
                                          : static_cast<int>(std::thread::hardware_concurrency()));
  const ComputeTarget target = ChooseComputeTarget(spec, options.device);
  const c10::Device device = target.device;

  BaseWeights base = [&] {
    // A model folder is read as the job's submitter; a store is this worker's to attach.
    const ActingAs as(spec.model.checkpoint.empty() ? nullptr : options.files_as);
    return BaseWeights::ForJob(spec);
  }();
  RefuseAgainstModel(spec, base);
  const ModelConfig& config = base.config();
  const JobData data = [&] {
    const ActingAs as(options.files_as);
    return LoadJobData(spec, config.vocab_size);
  }();
  const SequenceSet& sequences = data.train;
  LS_LOG_INFO("job {}: {}", spec.name, DescribeJobData(spec, data));
  LS_LOG_INFO("job {}: {} {} layers, device {}, dtype {}", spec.name, config.model_type,
              config.num_hidden_layers, device.str(), target.dtype_name);
  TrainModel m = BuildModel(spec, options, base, target, should_stop);

  // From here on every file the job opens or creates is opened as its submitter.
  const ActingAs as_submitter(options.files_as);
  // Adapter and optimizer: fresh, or from the latest checkpoint.
  const std::string fingerprint = Fingerprint(spec);
  const LoraSettings settings = LoraSettingsFromSpec(spec.lora);
  OutputDirLock dir_lock = LockOutputDir(spec, options);
  TrainStart start = StartOrResume(spec, options.resume, config, device, settings, fingerprint);
  const std::string& resume_dir = start.resume_dir;
  LoraAdapter& adapter = *start.adapter;
  AdamW& optimizer = *start.optimizer;
  TrainState& state = start.state;

  TrainResult result;
  result.start_step = state.step;
  result.steps_done = state.step;
  const int64_t total = data.steps;
  const int64_t rows = spec.train.batch_size, accum = spec.train.grad_accum;
  const std::string stats_path = spec.train.stats_file.empty()
                                     ? (fs::path(spec.train.output_dir) / "stats.jsonl").string()
                                     : spec.train.stats_file;
  std::error_code ec;
  fs::create_directories(spec.train.output_dir, ec);
  if (ec) throw Error(ErrorCode::kIo, "train.output_dir: cannot create " + spec.train.output_dir);
  Sampler sampler(sequences.count, spec.train.seed);
  const auto params = adapter.Params();
  MicroBatchRunner runner(*m.model, adapter, /*allow_graphs=*/true);
  int64_t last_saved = resume_dir.empty() ? -1 : state.step;
  result.checkpoint_dir = resume_dir;
  // Every write of the job first makes sure that the folder is still this attempt's: a later
  // attempt that took it over (this one was declared dead, paused say) fences it.
  auto save = [&]() {
    dir_lock.RequireOwned();
    result.checkpoint_dir =
        SaveCheckpoint(spec.train.output_dir, adapter, optimizer, state, base.name_or_path(),
                       {spec.train.keep_checkpoints, spec.train.keep_best});
    last_saved = state.step;
  };

  auto stopped = [&](const char* where) {
    if (last_saved != state.step) save();
    result.stopped = true;
    LS_LOG_INFO("job {}: stopped {} step {} (checkpoint saved)", spec.name, where, state.step);
    return result;
  };
  StepInput input;  // the next step's, made while the device runs the step before
  while (state.step < total) {
    dir_lock.RequireOwned();
    if (should_stop && should_stop()) return stopped("at");
    const auto t0 = Clock::now();
    const double lr = spec.optim.lr * ScheduleFactor(spec.optim.schedule, state.step,
                                                     spec.optim.warmup_steps, total);
    StepStats stats;
    try {
      TrainStep(spec, sequences, sampler, *m.model, *m.provider, runner, optimizer, params, lr,
                device, /*prepare_next=*/state.step + 1 < total, &input, &state, &stats);
    } catch (const std::exception&) {
      if (!m.stoppable->stopped()) throw;
      // Stopped between two blocks. The update comes after every micro-batch, so the adapter
      // and the optimizer are still those of the last completed step.
      return stopped("inside");
    }
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    SetStepFigures(state.step, total, rows * accum * sequences.seq_len, seconds, &stats);
    const bool checkpoint_now =
        state.step == total ||
        (spec.train.checkpoint_every > 0 && state.step % spec.train.checkpoint_every == 0);
    if (EvaluateIfDue(spec, data, *m.model, adapter, checkpoint_now, &state, &stats))
      result.final_eval_loss = stats.eval_loss;
    dir_lock.RequireOwned();
    AppendStats(stats_path, stats);
    result.steps_done = state.step;
    result.final_loss = stats.loss;
    result.graphed_micro_batches = runner.replays();
    if (on_step) on_step(stats);
    if (checkpoint_now && state.step < total) save();
  }
  if (last_saved != state.step) save();
  dir_lock.RequireOwned();
  adapter.Save(spec.train.output_dir, base.name_or_path());
  result.adapter_dir = spec.train.output_dir;
  return result;
}

int RunTrainCommand(const std::string& job_path, const TrainOptions& options,
                    const std::atomic<int>* stop_signal) {
  JobSpec spec = LoadJobSpec(job_path);
  const auto start = Clock::now();
  int64_t first_step = -1;
  auto on_step = [&](const StepStats& s) {
    if (first_step < 0) first_step = s.step - 1;
    const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
    const double per_step = elapsed / static_cast<double>(s.step - first_step);
    std::printf("%s\n",
                FormatProgress(s, per_step * static_cast<double>(s.total_steps - s.step)).c_str());
    std::fflush(stdout);
  };
  auto should_stop = [stop_signal] { return stop_signal && stop_signal->load() != 0; };
  TrainResult r = RunTraining(spec, options, on_step, should_stop);
  if (r.stopped) {
    std::printf(
        "stopped by signal %d at step %lld: checkpoint in %s (run the same command "
        "to resume)\n",
        stop_signal->load(), static_cast<long long>(r.steps_done), r.checkpoint_dir.c_str());
    return 128 + stop_signal->load();
  }
  std::printf("done: %lld steps, final loss %.4f", static_cast<long long>(r.steps_done),
              r.final_loss);
  if (!std::isnan(r.final_eval_loss)) std::printf(", eval loss %.4f", r.final_eval_loss);
  std::printf(", adapter in %s\n", r.adapter_dir.c_str());
  return 0;
}

}  // namespace lorastream::worker
