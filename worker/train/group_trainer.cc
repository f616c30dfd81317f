// The one job group's training loop (worker/train/group_trainer.h) for every family
// (worker/train/family.h); RunTraining is a group of one.
#include "worker/train/group_trainer.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <limits>
#include <map>
#include <thread>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "common/base/error.h"
#include "common/base/log.h"
#include "common/job/job_access.h"
#include "common/job/step_stats_json.h"
#include "common/posix/acting_as.h"
#include "common/posix/durable_file.h"
#include "common/posix/unique_fd.h"
#include "worker/train/adamw.h"
#include "worker/train/family.h"
#include "worker/train/group_members.h"
#include "worker/train/step_profile.h"
#include "worker/train/stoppable_provider.h"
#include "worker/train/train_state.h"

namespace lorastream::worker {

namespace fs = std::filesystem;

namespace {

using Clock = std::chrono::steady_clock;

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

// The figures a step reads from the device: each micro-batch's loss, then the gradient norm.
at::Tensor GradNormFigure(const at::Tensor& norm, const at::Tensor& like) {
  return norm.defined() ? norm.to(at::kFloat).reshape({}) : at::zeros({}, like.options());
}

}  // namespace

// One job of the group: its lock, optimizer, state, checkpoints and statistics around its
// family part (FamilyJob: data, adapter, inputs).
class GroupTrainer::Job {
 public:
  Job(GroupJob job, size_t index, const JobSpec& first, const TrainOptions& options,
      FamilyGroup& family)
      : index_(index), spec_(std::move(job.spec)), in_(std::move(job)), family_(family) {
    ResolveJobSpec(spec_);
    const std::string refusal = GroupRefusal(first, spec_, options.device);
    if (!refusal.empty()) throw Error(ErrorCode::kRefused, refusal);
    job_ = family.MakeJob(spec_);
    files_ = family.CheckpointFiles();
    lock_ = std::make_unique<OutputDirLock>(OutputDirLock::CreateAndAcquire(
        spec_.train.output_dir, in_.lock_holder.empty() ? options.lock_holder : in_.lock_holder));
    Start(options.resume);
    total_ = job_->total_steps();
    stats_path_ = spec_.train.stats_file.empty()
                      ? (fs::path(spec_.train.output_dir) / "stats.jsonl").string()
                      : spec_.train.stats_file;
    DropStatsAfter(stats_path_, state_.step);  // steps an interrupted run wrote after it
  }

  size_t index() const { return index_; }
  const std::string& name() const { return spec_.name; }
  const JobSpec& spec() const { return spec_; }
  FamilyJob& family_job() { return *job_; }
  bool done() const { return state_.step >= total_; }
  bool StopRequested() const { return in_.should_stop && in_.should_stop(); }
  int64_t micro_batches() const { return job_->micro_batches(); }
  const TrainResult& result() const { return result_; }

  // A checkpoint unless the current step has one; the job leaves stopped.
  void Stop(const char* where = "at") {
    if (last_saved_ != state_.step) Save();
    result_.stopped = true;
    LS_LOG_INFO("job {}: stopped {} step {} (checkpoint saved)", spec_.name, where, state_.step);
  }

  // The end: the last checkpoint and the final adapter.
  void Complete() {
    if (last_saved_ != state_.step) Save();
    lock_->RequireOwned();
    job_->SaveAdapter(spec_.train.output_dir);
    result_.adapter_dir = spec_.train.output_dir;
    result_.done_line = job_->DescribeDone(result_.start_step + 1, result_.steps_done,
                                           result_.final_loss, result_.final_eval_loss);
  }

  // The step's start: its learning rate and its input.
  void Begin() {
    // Every write of the job first makes sure that the folder is still this attempt's: a
    // later attempt that took it over (this one was declared dead, paused say) fences it.
    lock_->RequireOwned();
    lr_ = spec_.optim.lr *
          ScheduleFactor(spec_.optim.schedule, state_.step, spec_.optim.warmup_steps, total_);
    job_->Begin(state_.step, state_.samples_seen);
    figures_.clear();
  }

  // A failed attempt at the step: its gradients and figures dropped (the step's input, made
  // in Begin, is kept for the next attempt). Zeroed in place: a CUDA graph may write them.
  void DiscardStep() {
    for (at::Tensor& p : params_)
      if (p.grad().defined()) p.mutable_grad().zero_();
    figures_.clear();
  }

  void AddLosses(const std::vector<at::Tensor>& losses) {
    for (const at::Tensor& loss : losses) figures_.push_back(loss.to(at::kFloat).reshape({}));
  }

  // After its micro-batches: clipping, AdamW, the gradients cleared, the next step's input
  // issued; the gradient norm joins the step's figures.
  void Update() {
    const at::Tensor norm = ClipGradNormAsync(params_, spec_.optim.grad_clip);
    figures_.push_back(GradNormFigure(norm, figures_.front()));
    optimizer_->Step(lr_);
    next_ = state_.samples_seen + job_->step_samples();
    job_->AfterUpdate(*optimizer_, state_.step + 1, next_);
  }

  const std::vector<at::Tensor>& figures() const { return figures_; }

  // The step's end, from its figures read from the device (v: each micro-batch's loss, then
  // the gradient norm) and the group's copy statistics: a non-finite loss fails the job (the
  // adapter in memory is then lost; checkpoints are written only after a step's loss is
  // read); else the state advances, and evaluation, statistics and checkpoints follow.
  void Finish(const double* v, int64_t n_losses, const StepStats& group_stats, double seconds,
              uint64_t group_captured_peak) {
    StepStats stats = group_stats;
    // A replay allocates nothing: its memory is what the captured micro-batch allocated.
    stats.peak_device_bytes =
        std::max({stats.peak_device_bytes, job_->captured_peak_bytes(), group_captured_peak});
    double loss_value = 0.0;
    for (int64_t m = 0; m < n_losses; ++m) loss_value += v[m];
    if (!std::isfinite(loss_value))
      throw Error(ErrorCode::kInternal, "job " + spec_.name + ": the loss is " +
                                            std::to_string(loss_value) + " at step " +
                                            std::to_string(state_.step + 1) + " (lower " +
                                            job_->learning_rate_key() + " or check the data)");
    stats.grad_norm = v[n_losses];
    const int64_t tokens = job_->step_tokens();
    state_.step += 1;
    state_.samples_seen = next_;
    stats.loss = loss_value;
    stats.learning_rate = lr_;
    stats.step = state_.step;
    stats.total_steps = total_;
    stats.tokens = tokens;
    stats.step_seconds = seconds;
    stats.tokens_per_second = seconds > 0 ? static_cast<double>(tokens) / seconds : 0.0;
    const bool checkpoint_now =
        state_.step == total_ ||
        (spec_.train.checkpoint_every > 0 && state_.step % spec_.train.checkpoint_every == 0);
    state_.eval_loss = std::numeric_limits<double>::quiet_NaN();
    if (job_->EvaluateIfDue(state_.step, checkpoint_now, &stats)) {
      state_.eval_loss = stats.eval_loss;
      result_.final_eval_loss = stats.eval_loss;
    }
    lock_->RequireOwned();
    AppendStats(stats_path_, stats);
    result_.steps_done = state_.step;
    result_.final_loss = stats.loss;
    result_.graphed_micro_batches = job_->graphed_micro_batches();
    if (in_.on_step) in_.on_step(stats);
    if (checkpoint_now && state_.step < total_) Save();
  }

 private:
  // A fresh adapter, or the newest checkpoint's adapter, AdamW moments and state, refused
  // when that checkpoint was written with other settings (read before its tensors).
  void Start(bool resume) {
    const std::string fingerprint = job_->Fingerprint();
    const std::string from = resume ? FindLatestCheckpoint(spec_.train.output_dir, files_) : "";
    if (!from.empty()) {
      state_ = ReadTrainerState(from);
      if (state_.fingerprint != fingerprint)
        throw Error(ErrorCode::kRefused, "resume: " + from +
                                             " was written by a job with other settings (" +
                                             state_.fingerprint + "); now: " + fingerprint +
                                             ". Use another output_dir or restore the settings.");
    } else {
      state_.seed = spec_.train.seed;
      state_.fingerprint = fingerprint;
    }
    job_->StartAdapter(from);
    params_ = job_->Params();
    AdamWOptions options{spec_.optim.beta1, spec_.optim.beta2, spec_.optim.eps,
                         spec_.optim.weight_decay};
    options.eight_bit = spec_.optim.type == "adamw8bit";
    optimizer_ = std::make_unique<AdamW>(params_, options);
    if (!from.empty()) {
      LoadOptimizerState(from, job_->ParamNames(), state_.step, *optimizer_);
      LS_LOG_INFO("job {}: resuming from {} (step {})", spec_.name, from, state_.step);
    }
    result_.start_step = state_.step;
    result_.steps_done = state_.step;
    result_.checkpoint_dir = from;
    last_saved_ = from.empty() ? -1 : state_.step;
  }

  void Save() {
    lock_->RequireOwned();
    result_.checkpoint_dir =
        SaveCheckpoint(spec_.train.output_dir, *job_, *optimizer_, state_,
                       {spec_.train.keep_checkpoints, spec_.train.keep_best}, files_);
    last_saved_ = state_.step;
  }

  size_t index_;
  JobSpec spec_;
  GroupJob in_;  // its callbacks
  FamilyGroup& family_;
  std::unique_ptr<FamilyJob> job_;
  std::vector<std::string> files_;       // a checkpoint's (the family's)
  std::unique_ptr<OutputDirLock> lock_;  // released after what it guards
  std::vector<at::Tensor> params_;
  std::unique_ptr<AdamW> optimizer_;
  TrainState state_;
  TrainResult result_;
  int64_t total_ = 0;
  int64_t last_saved_ = -1;
  std::string stats_path_;
  double lr_ = 0.0;
  std::vector<at::Tensor> figures_;
  int64_t next_ = 0;  // samples_seen after this step
};

GroupTrainer::GroupTrainer(const JobSpec& first, const TrainOptions& options)
    : options_(options), first_(first) {
  ResolveJobSpec(first_);
  at::set_num_threads(options.threads > 0 ? options.threads
                                          : static_cast<int>(std::thread::hardware_concurrency()));
  // A stop asked by every job of the group ends a step between two blocks.
  family_ = MakeFamilyGroup(first_, options_, [this] { return members_->AllStopRequested(); });
  as_submitter_ = std::make_unique<ActingAs>(options.files_as);
  // Every change of composition: what the family keeps of its jobs' tensors is dropped.
  members_ = std::make_unique<GroupMembers<Job>>(
      family_->log_name(), [family = family_.get()] { family->MembersChanged(); });
}

GroupTrainer::~GroupTrainer() {
  family_->Release();  // what reads the jobs' tensors, before the jobs
  members_.reset();    // before the model they train through
}

size_t GroupTrainer::size() const { return members_->size(); }

size_t GroupTrainer::Add(GroupJob job) {
  const std::string name = job.spec.name;
  return members_->Add(name, [&](size_t index) {
    return std::make_unique<Job>(std::move(job), index, first_, options_, *family_);
  });
}

std::string GroupTrainer::JoinRefusal(const JobSpec& spec) const {
  // The plan's memory counts the first job (index 0) whether or not it is still training.
  std::vector<JobSpec> others;
  for (const auto& job : members_->jobs())
    if (job->index() != 0) others.push_back(job->spec());
  try {
    others.push_back(spec);
    ResolveJobSpec(others.back());
    return family_->JoinRefusal(others);
  } catch (const std::exception& e) {
    // No estimate can be made (its files cannot be read, say): it joins, and fails alone when
    // it starts, with its own error.
    LS_LOG_DEBUG("job {}: no memory estimate to admit it by ({})", spec.name, e.what());
    return "";
  }
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

  // The shared work: every job's forward and backward, then their updates. When the step of
  // several jobs fails (an allocation failure, say), which job caused it cannot be told from
  // the error: the group splits, and from this step on each job's forward and backward run
  // alone, one after another (each its own pass over the blocks). A job that fails alone
  // leaves with its own error; the others train on, their step as it would have been. A
  // failure outside the forward and backward (the updates, reading the figures) is the
  // group's: every job leaves with it.
  if (jobs.size() <= 1) split_ = false;  // one job: nothing to split (a joiner shares again)
  StoppableProvider& provider = family_->provider();
  at::Tensor host;
  std::map<const Job*, std::exception_ptr> failed_alone;
  try {
    std::vector<Job*> all;
    for (const auto& job : jobs) all.push_back(job.get());
    if (!split_) {
      try {
        provider.BeginStep();
        RunTogether(all);
      } catch (...) {
        if (provider.stopped() || all.size() == 1) throw;
        LS_LOG_WARN(
            "{}: a step of {} jobs failed ({}); the group splits: each job runs its step "
            "alone",
            family_->log_name(), all.size(), FailureMessage(std::current_exception()));
        split_ = true;
        for (Job* job : all) job->DiscardStep();
      }
    }
    if (split_) {
      for (Job* job : all) {
        try {
          provider.BeginStep();
          RunTogether({job});
        } catch (...) {
          if (provider.stopped()) throw;
          failed_alone[job] = std::current_exception();
          job->DiscardStep();
        }
      }
    }
    std::vector<at::Tensor> figures;
    for (Job* job : all) {
      if (failed_alone.count(job)) continue;
      job->Update();
      figures.insert(figures.end(), job->figures().begin(), job->figures().end());
    }
    // The step's one wait for the device, for every job's figures.
    if (!figures.empty()) host = at::stack(figures).to(at::kCPU).to(at::kDouble).contiguous();
  } catch (...) {
    const std::exception_ptr error = std::current_exception();
    if (provider.stopped()) {
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
  const uint64_t group_peak = family_->captured_peak_bytes();
  // Each job's figures, in the group's order (a job that leaves is erased: the next takes its
  // position); a job whose step failed alone leaves with its error.
  const double* v = host.defined() ? host.data_ptr<double>() : nullptr;
  members_->Sweep([&](Job& job) {
    if (const auto f = failed_alone.find(&job); f != failed_alone.end())
      std::rethrow_exception(f->second);
    const double* figures = v;
    const int64_t n = static_cast<int64_t>(job.figures().size()) - 1;  // losses, then the norm
    v += n + 1;
    job.Finish(figures, n, group_stats, seconds, group_peak);
    if (!job.done()) return false;
    job.Complete();
    return true;
  });
  return !members_->empty();
}

void GroupTrainer::RunTogether(const std::vector<Job*>& jobs) {
  std::vector<FamilyJob*> parts;
  for (Job* job : jobs) parts.push_back(&job->family_job());
  const std::vector<std::vector<at::Tensor>> losses = family_->RunStep(parts);
  LS_CHECK(losses.size() == jobs.size(), "a family's step returned another count of jobs");
  // The injected failure comes after the backward, when every job's gradients hold this
  // attempt's sums: a retry must start from none of them.
  for (Job* job : jobs)
    if (!options_.debug_fail_job.empty() && job->name() == options_.debug_fail_job)
      throw Error(ErrorCode::kInternal,
                  "debug_fail_job: job " + job->name() +
                      ": the step's allocation failed (a fault injected by the test option)");
  for (size_t j = 0; j < jobs.size(); ++j) jobs[j]->AddLosses(losses[j]);
}

void GroupTrainer::Run() {
  std::unique_ptr<StepProfile> profile;
  if (!options_.profile.path.empty())
    profile = std::make_unique<StepProfile>(options_.profile, options_.device);
  while (!members_->empty()) {
    if (profile) profile->BeforeStep();
    Step();
    if (profile) profile->AfterStep();
  }
}

std::vector<GroupJobOutcome> RunGroupTraining(std::vector<GroupJob> jobs,
                                              const TrainOptions& options) {
  LS_CHECK(!jobs.empty(), "a group needs at least one job");
  std::vector<GroupJobOutcome> out(jobs.size());
  std::vector<size_t> left(jobs.size());  // positions in `jobs` not trained yet
  for (size_t j = 0; j < jobs.size(); ++j) left[j] = j;
  bool profiled = false;  // --profile records the first group's steps
  while (!left.empty()) {
    GroupJob& first = jobs[left.front()];
    TrainOptions group_options = options;
    if (profiled) group_options.profile.path.clear();
    profiled = true;
    if (group_options.plan_group.empty())  // the plan leaves room for every job left
      for (size_t k = 1; k < left.size(); ++k)
        group_options.plan_group.push_back(jobs[left[k]].spec);
    std::unique_ptr<GroupTrainer> group;
    for (bool alone : {false, true}) {
      if (alone) group_options.plan_group.clear();
      try {
        group = std::make_unique<GroupTrainer>(first.spec, group_options);
        break;
      } catch (const Error& e) {
        // One job alone keeps its error as it was; in a group, a refusal is one job's.
        if (jobs.size() == 1 || e.code() != ErrorCode::kRefused) throw;
        if (!alone && !group_options.plan_group.empty()) {
          LS_LOG_INFO(
              "the group of {} jobs cannot be planned ({}); planned for job {} alone, the "
              "others join as its memory allows",
              left.size(), e.what(), first.spec.name);
          continue;
        }
        out[left.front()] = {first.spec.name, left.front(), {}, std::current_exception()};
        break;
      }
    }
    if (!group) {
      left.erase(left.begin());
      continue;
    }
    std::map<size_t, size_t> position;  // the group's index of a job -> its place in `jobs`
    std::vector<size_t> waiting;
    for (size_t k = 0; k < left.size(); ++k) {
      if (k > 0)
        if (const std::string why = group->JoinRefusal(jobs[left[k]].spec); !why.empty()) {
          LS_LOG_INFO("{}: it trains after the group", why);
          waiting.push_back(left[k]);
          continue;
        }
      position[group->Add(std::move(jobs[left[k]]))] = left[k];
    }
    group->Run();
    for (GroupJobOutcome& o : group->TakeLeft()) {
      const size_t at = position.at(o.index);
      o.index = at;
      out[at] = std::move(o);
    }
    left = std::move(waiting);
  }
  return out;
}

}  // namespace lorastream::worker
