// The LLM family's part of a group (worker/llm/llm_family.h).
#include "worker/llm/llm_family.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

#include <ATen/ATen.h>

#include "common/base/error.h"
#include "common/base/log.h"
#include "common/formats/checkpoint_dir.h"
#include "common/formats/manifest_tokenizer.h"
#include "common/formats/tokenizer_id.h"
#include "common/job/job_data.h"
#include "common/job/job_kind.h"
#include "common/posix/acting_as.h"
#include "worker/model/base_weights.h"
#include "worker/model/lm_head.h"
#include "worker/model/lora.h"
#include "worker/model/model.h"
#include "worker/stream/resident_provider.h"
#include "worker/train/adamw.h"
#include "worker/train/evaluate.h"
#include "worker/train/micro_batch_runner.h"
#include "worker/train/stoppable_provider.h"

namespace lorastream::worker::llm {

namespace {

// The settings a resume must keep: changing any of them would silently train another job.
std::string JobFingerprint(const JobSpec& s) {
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

class Job;

// The group's base, provider, LM head, model and group runner. Members are destroyed in
// reverse order: the model before the providers it points at.
class Group final : public FamilyGroup {
 public:
  Group(const JobSpec& first_spec, const TrainOptions& options, std::function<bool()> all_stop)
      : target_(ChooseComputeTarget(first_spec, options.device)) {
    // lora.init_from: the adapter's rank, alpha and targets where the job leaves them out,
    // before anything is planned.
    JobSpec first = first_spec;
    ApplyInitFrom(first.lora);
    {
      // A model folder is read as the job's submitter; a store is this worker's to attach.
      const ActingAs as(first.model.checkpoint.empty() ? nullptr : options.files_as);
      base_ = std::make_unique<BaseWeights>(BaseWeights::ForJob(first));
    }
    RefuseAgainstModel(first, *base_);
    const ModelConfig& config = base_->config();
    LS_LOG_INFO("group of {}: {} {} layers, device {}, dtype {}", first.name, config.model_type,
                config.num_hidden_layers, target_.device.str(), target_.dtype_name);
    const c10::Device device = target_.device;
    auto stoppable = std::make_unique<StoppableProvider>(
        options.make_provider ? options.make_provider(first, *base_, device.str(),
                                                      target_.dtype_name, options.plan_group)
                              : std::make_unique<ResidentProvider>(*base_, device, target_.dtype),
        std::move(all_stop), device.is_cuda());
    stoppable_ = stoppable.get();
    provider_ = std::move(stoppable);
    // The LM head: the provider's when its plan streams it, else resident on the device.
    HeadProvider* head = provider_->lm_head();
    if (head == nullptr) {
      resident_head_ =
          MakeResidentHead(base_->rest(), device, target_.dtype, options.head_slice_rows);
      head = resident_head_.get();
    }
    RestWeights rest;
    // The embedding table stays in host RAM (the store's shared memory or the checkpoint's
    // mapping): each micro-batch's rows are gathered there and only they are copied.
    rest.embed_tokens = base_->rest().embed_tokens;
    rest.packed_embed = base_->rest().packed_embed;
    rest.norm = base_->rest().norm.to(device, target_.dtype);
    model_ = std::make_unique<CausalLm>(config, rest, provider_.get(), device, target_.dtype, head);
    group_runner_ = std::make_unique<GroupMicroBatchRunner>(*model_);
  }

  std::string log_name() const override { return "group"; }
  std::unique_ptr<FamilyJob> MakeJob(const JobSpec& spec) override;
  std::vector<std::string> CheckpointFiles() const override { return CheckpointRequiredFiles(); }
  StoppableProvider& provider() override { return *stoppable_; }
  std::vector<std::vector<at::Tensor>> RunStep(const std::vector<FamilyJob*>& jobs) override;
  // The streaming provider keeps the estimate its plan was checked with.
  std::string JoinRefusal(const std::vector<JobSpec>& others) const override {
    return stoppable_->JoinRefusal(others);
  }
  void MembersChanged() override {
    if (group_runner_) group_runner_->Forget();
  }
  void Release() override { group_runner_.reset(); }  // its graphs accumulate into the jobs'
  uint64_t captured_peak_bytes() const override {
    return group_runner_ ? group_runner_->captured_peak_bytes() : 0;
  }

  const BaseWeights& base() const { return *base_; }
  CausalLm& model() { return *model_; }
  c10::Device device() const { return target_.device; }

 private:
  ComputeTarget target_;
  std::unique_ptr<BaseWeights> base_;
  std::unique_ptr<BlockProvider> provider_;
  StoppableProvider* stoppable_ = nullptr;       // provider_
  std::unique_ptr<HeadProvider> resident_head_;  // the head, when the provider does not stream it
  std::unique_ptr<CausalLm> model_;
  // The micro-batches of two or more jobs (a group of one runs through its job's runner).
  std::unique_ptr<GroupMicroBatchRunner> group_runner_;
  size_t next_job_id_ = 0;
};

// One job: its data, sampler, adapter, runner and its steps' inputs.
class Job final : public FamilyJob {
 public:
  Job(const JobSpec& spec, Group& group, size_t id) : spec_(spec), group_(group), id_(id) {
    ApplyInitFrom(spec_.lora);
    const BaseWeights& base = group.base();
    RefuseAgainstModel(spec_, base);
    data_ = LoadJobData(spec_, base.config().vocab_size);
    LS_LOG_INFO("job {}: {}", spec_.name, DescribeJobData(spec_, data_));
    settings_ = LoraSettingsFromSpec(spec_.lora);
    sampler_ = std::make_unique<Sampler>(data_.train.count, spec_.train.seed);
  }

  std::string Fingerprint() const override { return JobFingerprint(spec_); }

  void StartAdapter(const std::string& resume_dir) override {
    const ModelConfig& config = group_.base().config();
    if (resume_dir.empty()) {
      // lora.init_from: the adapter's weights instead of peft's init, a fresh optimizer.
      adapter_ = std::make_unique<LoraAdapter>(
          spec_.lora.init_from.empty()
              ? LoraAdapter::Init(config, settings_, spec_.train.seed, group_.device())
              : LoraAdapter::InitFrom(spec_.lora.init_from, config, settings_, group_.device()));
    } else {
      adapter_ =
          std::make_unique<LoraAdapter>(LoraAdapter::Load(resume_dir, config, group_.device()));
      // The adapter file carries its settings; the job must still ask for the same ones.
      if (adapter_->settings().TargetNames() != settings_.TargetNames() ||
          adapter_->settings().rank != settings_.rank)
        throw Error(ErrorCode::kRefused,
                    "resume: " + resume_dir + " holds an adapter with other lora.rank/targets");
    }
    runner_ = std::make_unique<MicroBatchRunner>(group_.model(), *adapter_, /*allow_graphs=*/true);
  }
  std::vector<at::Tensor> Params() const override { return adapter_->Params(); }
  std::vector<std::string> ParamNames() const override { return adapter_->ParamNames(); }
  void SaveAdapter(const std::string& dir) const override {
    adapter_->Save(dir, group_.base().name_or_path());
  }
  std::string DescribeDone(int64_t first_step, int64_t last_step, double loss,
                           double eval_loss) const override {
    char buf[128];
    std::snprintf(buf, sizeof buf, "done: %lld steps, final loss %.4f",
                  static_cast<long long>(last_step), loss);
    std::string line = buf;
    if (!std::isnan(eval_loss)) {
      std::snprintf(buf, sizeof buf, ", eval loss %.4f", eval_loss);
      line += buf;
    }
    return line + ", adapter in " + spec_.train.output_dir;
  }

  int64_t total_steps() const override { return data_.steps; }
  int64_t micro_batches() const override { return spec_.train.grad_accum; }
  void Begin(int64_t step, int64_t samples_seen) override {
    if (input_.position != samples_seen)
      input_ =
          PrepareStep(spec_, data_.train, *sampler_, group_.model(), samples_seen, group_.device());
    divisor_ = group_.model().LossDivisor(input_.n_targets);
    step_ = step;
  }
  int64_t step_samples() const override { return spec_.train.batch_size * spec_.train.grad_accum; }
  int64_t step_tokens() const override { return step_samples() * data_.train.seq_len; }
  void AfterUpdate(AdamW& optimizer, int64_t next_step, int64_t next_samples) override {
    runner_->ZeroGrad(optimizer);
    input_ = next_step < data_.steps ? PrepareStep(spec_, data_.train, *sampler_, group_.model(),
                                                   next_samples, group_.device())
                                     : StepInput{};
  }
  bool EvaluateIfDue(int64_t step, bool checkpoint_now, StepStats* stats) override {
    if (!(data_.eval.count > 0 &&
          (checkpoint_now || (spec_.eval.every > 0 && step % spec_.eval.every == 0))))
      return false;
    const EvalResult eval =
        Evaluate(group_.model(), *adapter_, data_.eval, spec_.train.batch_size, spec_.eval.batches);
    stats->eval_loss = eval.loss;
    stats->eval_tokens = eval.tokens;
    return true;
  }
  uint64_t captured_peak_bytes() const override { return runner_->captured_peak_bytes(); }
  int64_t graphed_micro_batches() const override { return runner_->replays() + group_replays_; }

  size_t id() const { return id_; }  // its identity in the group's graphs

  // Micro-batch m's part of a group micro-batch.
  GroupMicroBatch MicroBatch(int64_t m) {
    const MicroBatchInput mb =
        m == 0 ? input_.first
               : MicroBatchOnDevice(group_.model(), input_.batches[m], group_.device());
    return GroupMicroBatch{
        mb.embeddings, mb.targets, divisor_, adapter_.get(),
        MixSeed(spec_.train.seed, 0xd209, static_cast<uint64_t>(step_), static_cast<uint64_t>(m))};
  }

  // Micro-batch m alone (a group of one): through the runner, a CUDA graph where it may.
  at::Tensor RunAlone(int64_t m) {
    const GroupMicroBatch mb = MicroBatch(m);
    return runner_->Run(mb.embeddings, mb.targets, mb.loss_divisor, mb.dropout_seed);
  }

  // Its micro-batch ran in a group's CUDA graph, which accumulates into its gradients.
  void CountGroupReplay() {
    runner_->KeepGradsInPlace();
    ++group_replays_;
  }

 private:
  JobSpec spec_;
  Group& group_;
  size_t id_;
  JobData data_;
  LoraSettings settings_;
  std::unique_ptr<Sampler> sampler_;
  std::unique_ptr<LoraAdapter> adapter_;
  std::unique_ptr<MicroBatchRunner> runner_;
  StepInput input_;  // the next step's, made while the device runs the step before
  at::Tensor divisor_;
  int64_t step_ = 0;
  int64_t group_replays_ = 0;  // micro-batches run in a group's CUDA graph
};

std::unique_ptr<FamilyJob> Group::MakeJob(const JobSpec& spec) {
  return std::make_unique<Job>(spec, *this, next_job_id_++);
}

std::vector<std::vector<at::Tensor>> Group::RunStep(const std::vector<FamilyJob*>& family_jobs) {
  std::vector<Job*> jobs;
  for (FamilyJob* j : family_jobs) jobs.push_back(static_cast<Job*>(j));
  std::vector<std::vector<at::Tensor>> losses(jobs.size());
  int64_t micro_batches = 0;
  for (const Job* job : jobs) micro_batches = std::max(micro_batches, job->micro_batches());
  for (int64_t m = 0; m < micro_batches; ++m) {
    if (jobs.size() == 1) {
      losses[0].push_back(jobs[0]->RunAlone(m));
      continue;
    }
    std::vector<size_t> in, indices;
    std::vector<GroupMicroBatch> parts;
    for (size_t j = 0; j < jobs.size(); ++j) {
      if (m >= jobs[j]->micro_batches()) continue;  // its step has fewer micro-batches
      in.push_back(j);
      indices.push_back(jobs[j]->id());
      parts.push_back(jobs[j]->MicroBatch(m));
    }
    bool graphed = false;
    const std::vector<at::Tensor> out = group_runner_->Run(parts, indices, &graphed);
    for (size_t k = 0; k < in.size(); ++k) {
      losses[in[k]].push_back(out[k]);
      if (graphed) jobs[in[k]]->CountGroupReplay();
    }
  }
  return losses;
}

}  // namespace

bool Accepts(const JobSpec& spec) { return IsLanguageModelJob(spec); }

std::unique_ptr<FamilyGroup> MakeGroup(const JobSpec& first, const TrainOptions& options,
                                       std::function<bool()> all_stop) {
  return std::make_unique<Group>(first, options, std::move(all_stop));
}

}  // namespace lorastream::worker::llm
