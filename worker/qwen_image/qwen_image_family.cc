// The Qwen-Image family's part of a group (worker/qwen_image/qwen_image_family.h).
#include "worker/qwen_image/qwen_image_family.h"

#include <cstdio>
#include <filesystem>
#include <sstream>

#include <ATen/ATen.h>

#include "common/base/device.h"
#include "common/base/error.h"
#include "common/base/format_bytes.h"
#include "common/base/log.h"
#include "common/formats/checkpoint_dir.h"
#include "common/formats/qwen_image_config.h"
#include "common/formats/qwen_image_layout.h"
#include "common/posix/acting_as.h"
#include "common/posix/memory_limit.h"
#include "store/attach.h"
#include "worker/model/base_weights.h"
#include "worker/model/flow_match.h"
#include "worker/model/model.h"
#include "worker/model/torch_device.h"
#include "worker/qwen_image/qwen_image_adapter_io.h"
#include "worker/qwen_image/qwen_image_base.h"
#include "worker/qwen_image/qwen_image_calibrate.h"
#include "worker/qwen_image/qwen_image_data.h"
#include "worker/qwen_image/qwen_image_model.h"
#include "worker/train/adamw.h"
#include "worker/train/dit_join.h"
#include "worker/train/stoppable_provider.h"

namespace lorastream::worker::qwen_image {

namespace fs = std::filesystem;

namespace {

class Group final : public FamilyGroup {
 public:
  Group(const JobSpec& first, const TrainOptions& options, std::function<bool()> all_stop) {
    const Device device = ParseDevice(options.device);
    device_ = TorchDevice(device);
    dtype_ = ScalarTypeOf(ComputeDType(first.train.dtype, device), "train.dtype");
    // The spec was validated (a checkpoint or a store: common/job/job_spec.cc).
    if (!first.model.store.empty()) {  // a store is this worker's to attach
      base_ = std::make_unique<QwenImageBase>(
          QwenImageBase::FromStore(first.model.store, dtype_, device_));
    } else {
      const ActingAs as(options.files_as);  // the checkpoint is read as the job's submitter
      base_ = std::make_unique<QwenImageBase>(
          QwenImageBase::Load(first.model.checkpoint, dtype_, device_));
    }
    files_as_ = options.files_as;
    QwenImagePlanning planning;
    {
      // The plan: the planner's within the budget (the jobs given with the first counted),
      // else stream.blocks_to_swap; the caches' headers are read as the submitter.
      const ActingAs as(options.files_as);
      planning = PlanQwenImageJob(base_->config(), base_->engine_manifest(), first,
                                  options.plan_group, device_, dtype_, /*predict=*/false);
    }
    // Joiners are admitted against the first job's estimate under this plan (no budget: all).
    const ResidencyPlan& plan = planning.plan;
    if (planning.budget > 0) {
      QwenImageMemoryInputs memory = planning.inputs;
      memory.group.clear();
      admission_ = std::make_unique<DitJoinAdmission>(
          QwenImageMemoryModel(memory), memory.job, plan, planning.budget,
          "the plan's budget (stream.gpu_memory_budget)",
          [this](const JobSpec& spec) { return QwenImageDitJob(spec, base_->config()); },
          options.files_as);
    }
    provider_ = std::make_unique<StoppableProvider>(
        base_->MakeEngine(plan, device_, options.engine), std::move(all_stop), device_.is_cuda());
    model_ = std::make_unique<QwenImageModel>(base_->config(), base_->rest(), provider_.get(),
                                              device_, dtype_);
    model_->SetTapedUnits(TapedBlocks(plan));
    LS_LOG_INFO(
        "Qwen-Image group: {} of {} blocks streamed{}, {} taped", plan.num_streamed(),
        base_->config().num_layers,
        plan.num_streamed() > 0 ? " through " + std::to_string(plan.ring_size) + " slots" : "",
        plan.taped_blocks);
  }

  std::string log_name() const override { return "Qwen-Image group"; }
  std::unique_ptr<FamilyJob> MakeJob(const JobSpec& spec) override;
  std::vector<std::string> CheckpointFiles() const override {
    return {kComfyAdapterFile, kQwenDiffusersAdapterFile, kTrainerStateFile};
  }
  StoppableProvider& provider() override { return *provider_; }
  std::vector<std::vector<at::Tensor>> RunStep(const std::vector<FamilyJob*>& jobs) override;
  // Within a budget, a joiner whose estimate beside the group's jobs exceeds it waits (it
  // trains once the group drains); without one, every job joins.
  std::string JoinRefusal(const std::vector<JobSpec>& others) const override {
    return admission_ ? admission_->JoinRefusal(others) : "";
  }

  const QwenImageBase& base() const { return *base_; }
  c10::Device device() const { return device_; }
  c10::ScalarType dtype() const { return dtype_; }
  const UserIdentity* files_as() const { return files_as_; }

 private:
  c10::Device device_{c10::kCPU};
  c10::ScalarType dtype_ = at::kFloat;
  std::unique_ptr<QwenImageBase> base_;
  std::unique_ptr<StoppableProvider> provider_;
  std::unique_ptr<QwenImageModel> model_;
  const UserIdentity* files_as_ = nullptr;
  std::unique_ptr<DitJoinAdmission> admission_;  // within a budget: joiners against it
};

class Job final : public FamilyJob {
 public:
  Job(const JobSpec& spec, Group& group) : spec_(spec), group_(group) {
    const ActingAs as(group.files_as());
    if (!spec_.lora.init_from.empty()) {
      // lora.init_from: the file's rank, alpha and targets where the job leaves them out.
      init_file_ = ComfyAdapterFile(spec_.lora.init_from);
      dit::ApplyDownUpInitFrom(
          ReadComfyAdapterInfo(init_file_, group.base().config()), init_file_, "lora.",
          [](const std::vector<std::string>& t) { return QwenImageTargets(t, "lora.targets"); },
          spec_.lora.rank, spec_.lora.alpha, spec_.lora.targets);
    }
    targets_ = QwenImageTargets(spec_.lora.targets, spec.source + ": key `lora.targets`");
    data_ = std::make_unique<QwenImageDataset>(spec.qwen_image.cache_dir, group.base().config(),
                                               spec.qwen_image.edit);
    const QwenImageJob& q = spec.qwen_image;
    sampling_ = {q.timestep_sampling, q.sigmoid_scale, q.discrete_flow_shift};
  }

  std::string Fingerprint() const override {
    std::ostringstream s;
    s << "qwen_image rank=" << spec_.lora.rank << " alpha=" << spec_.lora.alpha << " targets=";
    for (const auto& t : targets_) s << t << ",";
    const QwenImageJob& q = spec_.qwen_image;
    s << " seed=" << spec_.train.seed << " batch=" << spec_.train.batch_size
      << " sampling=" << q.timestep_sampling << "/" << q.sigmoid_scale << "/"
      << q.discrete_flow_shift << " cache=" << q.cache_dir << (q.edit ? " edit" : "");
    return s.str();
  }
  void StartAdapter(const std::string& resume_dir) override {
    adapter_ = std::make_unique<QwenImageAdapter>(
        group_.base().config(), targets_, spec_.lora.rank, spec_.lora.alpha,
        MixSeed(spec_.train.seed, 0xada7), group_.device());
    if (!resume_dir.empty()) {
      LoadComfyAdapter((fs::path(resume_dir) / kComfyAdapterFile).string(), *adapter_);
    } else if (!init_file_.empty()) {  // its weights, a fresh optimizer (not a resume)
      const ActingAs as(group_.files_as());
      LoadComfyAdapter(init_file_, *adapter_);
    }
    LS_LOG_INFO(
        "job {}: Qwen-Image: {} images in {} buckets, {} adapted modules (rank {}, "
        "alpha {})",
        spec_.name, data_->size(), data_->buckets(), adapter_->modules().size(), spec_.lora.rank,
        spec_.lora.alpha);
  }
  std::vector<at::Tensor> Params() const override { return adapter_->Params(); }
  std::vector<std::string> ParamNames() const override {
    std::vector<std::string> out;
    for (const auto& [module, m] : adapter_->modules()) {
      out.push_back(ComfyModuleName(module) + ".lora_down.weight");
      out.push_back(ComfyModuleName(module) + ".lora_up.weight");
    }
    return out;
  }
  void SaveAdapter(const std::string& dir) const override { SaveQwenImageAdapters(*adapter_, dir); }
  std::string DescribeDone(int64_t first_step, int64_t last_step, double loss,
                           double) const override {
    char buf[160];
    std::snprintf(buf, sizeof buf, "done: steps %lld..%lld, final loss %.6f",
                  static_cast<long long>(first_step), static_cast<long long>(last_step), loss);
    const std::string& dir = spec_.train.output_dir;
    return std::string(buf) + "\nadapter (ComfyUI): " + dir + "/" + kComfyAdapterFile +
           "\nadapter (diffusers load_lora_weights): " + dir + "/" + kQwenDiffusersAdapterFile;
  }
  int64_t total_steps() const override { return spec_.train.steps; }
  void Begin(int64_t step, int64_t) override {
    input_ = MakeQwenImageStep(data_->Batch(step, spec_.train.batch_size, spec_.train.seed),
                               spec_.train.seed, step, sampling_, group_.device(), group_.dtype());
  }
  int64_t step_samples() const override { return input_.images; }
  int64_t step_tokens() const override { return input_.image_tokens; }
  void AfterUpdate(AdamW& optimizer, int64_t, int64_t) override { optimizer.ZeroGrad(); }

  const QwenImageStepInput& input() const { return input_; }
  const QwenImageAdapter& adapter() const { return *adapter_; }

 private:
  JobSpec spec_;
  Group& group_;
  std::vector<std::string> targets_;
  std::string init_file_;  // lora.init_from's ComfyUI file, or ""
  std::unique_ptr<QwenImageDataset> data_;
  std::unique_ptr<QwenImageAdapter> adapter_;
  dit::TimestepSampling sampling_;
  QwenImageStepInput input_;
};

std::unique_ptr<FamilyJob> Group::MakeJob(const JobSpec& spec) {
  return std::make_unique<Job>(spec, *this);
}

std::vector<std::vector<at::Tensor>> Group::RunStep(const std::vector<FamilyJob*>& family_jobs) {
  std::vector<const QwenImageBatch*> batches;
  std::vector<const QwenImageAdapter*> adapters;
  std::vector<const at::Tensor*> targets;
  for (FamilyJob* j : family_jobs) {
    const Job& job = static_cast<const Job&>(*j);
    batches.push_back(&job.input().batch);
    adapters.push_back(&job.adapter());
    targets.push_back(&job.input().target);
  }
  const std::vector<at::Tensor> losses = dit::FlowLossesBackward(
      model_->ForwardGroup(batches, adapters, /*checkpointed=*/true), targets);
  std::vector<std::vector<at::Tensor>> out;
  for (const at::Tensor& loss : losses) out.push_back({loss});
  return out;
}

// The layout a job's base has: its store's (refused naming the store's family unless it
// serves Qwen-Image), or its checkpoint's packed in `dtype`.
Manifest QwenImageJobManifest(const JobSpec& spec, DType dtype) {
  if (spec.model.store.empty())
    return QwenImageManifest(QwenImageCheckpointReader::Open(spec.model.checkpoint).config(), dtype,
                             Manifest{}.alignment);
  const store::AttachedStore store = store::AttachedStore::Attach(spec.model.store);
  RequireStoreFamily(store.manifest(), spec.model.store, ModelFamily::kQwenImage,
                     kQwenImageServeHint);
  return store.manifest();
}

}  // namespace

bool Accepts(const JobSpec& spec) { return spec.is_qwen_image; }

int RunPlan(const std::vector<std::string>& job_paths, const PlanCommandOptions& options) {
  const Device device = ParseDevice(options.device);
  const c10::Device torch_device = TorchDevice(device);
  for (const std::string& path : job_paths) {
    const JobSpec spec = LoadJobSpec(path);
    const DType dtype = ComputeDType(spec.train.dtype, device);
    const Manifest m = QwenImageJobManifest(spec, dtype);
    const QwenImagePlanning p =
        PlanQwenImageJob(m.qwen_image, m, spec, {}, torch_device,
                         ScalarTypeOf(dtype, "train.dtype"), /*predict=*/true);
    std::printf("job %s: Qwen-Image, %zu blocks of %s (%s), %d streamed through %d slots\n%s",
                spec.name.c_str(), m.blocks.size(), FormatBytes(m.blocks.front().nbytes).c_str(),
                ShortDTypeName(dtype), p.plan.num_streamed(), p.plan.ring_size,
                DescribeQwenImagePlanning(p).c_str());
  }
  return 0;
}

std::unique_ptr<FamilyGroup> MakeGroup(const JobSpec& first, const TrainOptions& options,
                                       std::function<bool()> all_stop) {
  return std::make_unique<Group>(first, options, std::move(all_stop));
}

}  // namespace lorastream::worker::qwen_image
