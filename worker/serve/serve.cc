#include "worker/serve/serve.h"

#include <unistd.h>

#include <chrono>
#include <deque>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "common/base/device.h"
#include "common/base/error.h"
#include "common/base/format_bytes.h"
#include "common/base/log.h"
#include "common/job/job_access.h"
#include "common/job/job_group.h"
#include "common/posix/shm_names.h"
#include "coordinator/client/curve.h"
#include "coordinator/client/worker_agent.h"
#include "store/attach.h"
#include "store/registry.h"
#include "worker/train/group_trainer.h"
#include "worker/train/stream_provider.h"
#include "worker/train/trainer.h"

#ifdef LORASTREAM_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace lorastream::worker {
namespace {

// The GPU's name and memory for registration ("", 0 on CPU).
void DescribeDevice(const std::string& name, client::WorkerAgentOptions* out) {
  const Device device = ParseDevice(name);
  if (!device.is_cuda()) return;
#ifdef LORASTREAM_HAVE_CUDA
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device.index) != cudaSuccess)
    throw Error(ErrorCode::kInvalidArgument, "no CUDA device " + name);
  out->gpu_name = prop.name;
  out->gpu_memory_bytes = prop.totalGlobalMem;
#else
  throw Error(ErrorCode::kUnsupported, "this build has no CUDA backend: use --device cpu");
#endif
}

// The stores offered at registration: what jobs call each (StoreInfo's name, with the
// fingerprint of its weights) and the store of this host it stands for.
struct OfferedStores {
  std::vector<StoreInfo> infos;
  std::map<std::string, std::string> local_name;  // offered as -> attached here

  // The store of this host that a job naming `store` attaches ("" stays "").
  std::string Local(const std::string& store) const {
    auto it = local_name.find(store);
    return it == local_name.end() ? store : it->second;
  }
};

OfferedStores DiscoverStores(const ServeOptions& options) {
  std::vector<StoreOffer> offers;
  for (const std::string& text : options.stores) offers.push_back(ParseStoreOffer(text));
  if (offers.empty())
    for (const store::StoreListing& s : store::ListStores()) {
      if (!s.alive || !s.record) continue;
      if (s.record->owner_uid != store::TrustedStoreOwner()) {
        LS_LOG_WARN("not offering store '{}': it belongs to {}, not to the store user {}", s.name,
                    DescribeUser(s.record->owner_uid), DescribeUser(store::TrustedStoreOwner()));
        continue;
      }
      offers.push_back(StoreOffer{s.name, s.name});
    }
  const bool discovered = options.stores.empty();
  OfferedStores out;
  for (const StoreOffer& offer : offers) {
    if (!out.local_name.emplace(offer.offered_as, offer.name).second)
      throw Error(ErrorCode::kInvalidArgument,
                  "two stores are offered as '" + offer.offered_as + "' (--store)");
    std::optional<store::AttachedStore> attached;
    try {
      attached.emplace(store::AttachedStore::AttachWhenReady(offer.name, options.store_wait_s));
    } catch (const Error& e) {
      if (!discovered) throw;  // a store named by --store must serve
      // One store of the host that this build cannot attach (another version's format, a
      // corrupt manifest, gone since the listing) does not keep the worker from the others.
      LS_LOG_WARN("not offering store '{}': {}", offer.name, e.what());
      out.local_name.erase(offer.offered_as);
      continue;
    }
    const store::AttachedStore& store = *attached;
    out.infos.push_back(StoreInfo{offer.offered_as, store.manifest().fingerprint});
    if (offer.name == offer.offered_as)
      LS_LOG_INFO("offering store '{}' (fingerprint {})", offer.name, store.manifest().fingerprint);
    else
      LS_LOG_INFO("offering store '{}' as '{}' (fingerprint {})", offer.name, offer.offered_as,
                  store.manifest().fingerprint);
  }
  if (out.infos.empty())
    LS_LOG_WARN("no store on this host: only jobs on checkpoint folders can run here");
  return out;
}

// The submitter of a job this worker runs as another user: checked before the job opens any
// path (Error kRefused naming the path and the user). nullopt when the worker runs as the
// submitter (nothing to check).
std::optional<UserIdentity> SubmitterToServe(const JobAssignment& a) {
  if (a.submitter_uid >= 0 && static_cast<uid_t>(a.submitter_uid) == ::geteuid())
    return std::nullopt;
  const std::string job = "job " + std::to_string(a.job_id);
  if (a.submitter_uid < 0)
    throw Error(ErrorCode::kRefused, job + " names no submitter; this worker runs as " +
                                         DescribeUser(::geteuid()) +
                                         " and runs other users' jobs only as them");
  UserIdentity who;
  try {
    who = LookupUser(static_cast<uid_t>(a.submitter_uid));
  } catch (const Error&) {
    throw Error(ErrorCode::kRefused, job + ": its submitter " + a.submitter + " (uid " +
                                         std::to_string(a.submitter_uid) +
                                         ") has no account on this worker's host");
  }
  CheckJobPathsAs(a.spec, who);
  return who;
}

// Holds the training thread after checkpoint `step` was reported while `hold` stays true.
// The agent's own thread keeps sending heartbeats and the queued reports meanwhile.
void HoldAtCheckpoint(const std::atomic<bool>& hold, const client::JobContext& ctx, int64_t step) {
  LS_LOG_INFO("job {}: holding after checkpoint {} (SIGUSR1); SIGUSR2 resumes",
              ctx.assignment.job_id, step);
  while (hold && !ctx.should_stop()) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  LS_LOG_INFO("job {}: resumed after checkpoint {}", ctx.assignment.job_id, step);
}

// The jobs of this worker's slots, trained as one job group on the agent's training thread.
// A job joins the group at a step boundary when it may share it (common/job/job_group.h, and the
// same submitter when a root worker acts as one); otherwise it waits, and the jobs behind it
// too, until the group has drained, and a new group starts from it. Every job ends through
// the slots on its own: completed, stopped or failed.
class GroupRunner {
 public:
  GroupRunner(const TrainOptions& train, const OfferedStores& stores, const std::atomic<bool>* hold)
      : train_(train), stores_(stores), hold_(hold) {}

  void Run(client::JobSlots& slots) {
    while (true) {
      for (auto& job : slots.Take(!group_ && pending_.empty())) Prepare(slots, std::move(job));
      if (!group_ && pending_.empty()) return;  // the agent stops
      Admit(slots);
      if (group_) {
        group_->Step();
        Collect(slots);
        if (group_->size() == 0) {
          group_.reset();  // its model and device memory go before the next group's
          LS_LOG_INFO("the job group has drained");
        }
      }
    }
  }

 private:
  // A job taken from the slots, resolved for this host.
  struct Job {
    std::shared_ptr<const client::JobContext> ctx;
    JobSpec spec;
    std::optional<UserIdentity> submitter;  // another user's job: checked (SubmitterToServe)
    bool waiting = false;                   // said that it waits for the group to drain
  };

  // The user a root worker opens a job's files as (nullptr: this process).
  static const UserIdentity* FilesAs(const Job& job) {
    return job.submitter && ::geteuid() == 0 ? &*job.submitter : nullptr;
  }

  void Prepare(client::JobSlots& slots, std::shared_ptr<const client::JobContext> ctx) {
    Job job;
    job.ctx = std::move(ctx);
    job.spec = job.ctx->assignment.spec;
    SetJobStore(job.spec, stores_.Local(job.spec.model.store));
    try {
      // Another user's job on a root worker: its files are opened and created as that user
      // (common/posix/acting_as.h), never handed over afterwards.
      job.submitter = SubmitterToServe(job.ctx->assignment);
    } catch (...) {
      slots.Finish(*job.ctx, client::FailedResult(std::current_exception(), job.ctx->assignment));
      return;
    }
    pending_.push_back(std::move(job));
  }

  // Why `job` cannot join the running group ("" when it can).
  std::string Refusal(const Job& job) const {
    auto uid = [](const UserIdentity* who) { return who ? static_cast<int64_t>(who->uid) : -1; };
    std::string why = GroupRefusal(group_first_, job.spec, train_.device);
    if (why.empty() && uid(FilesAs(job)) != uid(group_files_as_))
      why = "job " + job.spec.name + " belongs to another submitter than the group's, whose " +
            "thread acts as one user";
    if (why.empty()) why = group_->JoinRefusal(job.spec);  // the group's memory holds it too
    return why;
  }

  // The pending jobs join the group in order, up to the first that cannot; a job stopped
  // before it joined ends at the step it would have resumed from.
  void Admit(client::JobSlots& slots) {
    while (!pending_.empty()) {
      Job& job = pending_.front();
      const JobAssignment& a = job.ctx->assignment;
      if (job.ctx->should_stop()) {
        client::JobResult stopped;
        stopped.kind = client::JobResult::Kind::kStopped;
        stopped.final_step = a.resume_step;
        slots.Finish(*job.ctx, stopped);
        pending_.pop_front();
        continue;
      }
      // Each job's output-folder lock names its own attempt: a later attempt of the job takes
      // the folder over from this one (common/job/job_access.h).
      const std::string holder =
          AttemptHolder(a.job_id, a.attempt, "lorastream-worker pid " + std::to_string(::getpid()));
      if (!group_) {
        // The group is planned for this job and the pending ones that may join it now; jobs
        // assigned later are not known (leaving room for guessed ones would refuse a job that
        // fits alone). A plan that cannot hold them all is made for this job alone.
        try {
          group_ = MakeGroup(job, JoinersOf(job));
        } catch (const Error& e) {
          if (e.code() != ErrorCode::kRefused || JoinersOf(job).empty()) {
            slots.Finish(*job.ctx, client::FailedResult(std::current_exception(), a));
            pending_.pop_front();
            continue;
          }
          LS_LOG_INFO(
              "job {}: the group cannot be planned with the jobs waiting beside it ({}); "
              "planned alone",
              a.job_id, e.what());
        } catch (...) {
          slots.Finish(*job.ctx, client::FailedResult(std::current_exception(), a));
          pending_.pop_front();
          continue;
        }
        if (!group_) try {
            group_ = MakeGroup(job, {});
          } catch (...) {
            slots.Finish(*job.ctx, client::FailedResult(std::current_exception(), a));
            pending_.pop_front();
            continue;
          }
        group_first_ = job.spec;
        group_submitter_ = job.submitter;
        group_files_as_ = group_submitter_ && ::geteuid() == 0 ? &*group_submitter_ : nullptr;
      } else if (const std::string why = Refusal(job); !why.empty()) {
        if (!job.waiting)
          LS_LOG_INFO("job {} waits until the job group has drained: {}", a.job_id, why);
        job.waiting = true;
        return;
      }
      const size_t index =
          group_->Add(GroupJob{job.spec, OnStep(job.ctx, job.spec),
                               [ctx = job.ctx] { return ctx->should_stop(); }, holder});
      members_[index] = job.ctx;
      pending_.pop_front();
      Collect(slots);  // a job that could not start has left at once
    }
  }

  // A group of the job's family started from `job`, its plan leaving room for `joiners`.
  std::unique_ptr<GroupTrainer> MakeGroup(const Job& job, std::vector<JobSpec> joiners) const {
    TrainOptions options = train_;
    options.files_as = FilesAs(job);
    options.plan_group = std::move(joiners);
    return std::make_unique<GroupTrainer>(job.spec, options);
  }

  // The pending jobs after `first` that may share a group started by it (the same family,
  // base, dtype and plan, and on a root worker the same submitter).
  std::vector<JobSpec> JoinersOf(const Job& first) const {
    auto uid = [](const UserIdentity* who) { return who ? static_cast<int64_t>(who->uid) : -1; };
    std::vector<JobSpec> out;
    for (size_t i = 1; i < pending_.size(); ++i) {
      const Job& other = pending_[i];
      if (GroupRefusal(first.spec, other.spec, train_.device).empty() &&
          uid(FilesAs(other)) == uid(FilesAs(first)))
        out.push_back(other.spec);
    }
    return out;
  }

  // A job's statistics and checkpoints, reported as they come. The trainer saves checkpoint N
  // right after on_step(N) returns, so step N + 1 is the first moment checkpoint N is known to
  // exist.
  std::function<void(const StepStats&)> OnStep(std::shared_ptr<const client::JobContext> ctx,
                                               const JobSpec& spec) const {
    const int64_t every = spec.train.checkpoint_every;
    const std::string output_dir = spec.train.output_dir;
    const std::atomic<bool>* hold = hold_;
    return [ctx = std::move(ctx), every, output_dir, hold](const StepStats& stats) {
      ctx->report_step(stats);
      const int64_t previous = stats.step - 1;
      if (every > 0 && previous > 0 && previous % every == 0) {
        ctx->report_checkpoint(previous, (std::filesystem::path(output_dir) /
                                          ("checkpoint-" + std::to_string(previous)))
                                             .string());
        if (hold != nullptr && *hold) HoldAtCheckpoint(*hold, *ctx, previous);
      }
    };
  }

  // The jobs that left the group end through the slots, each with its own outcome.
  void Collect(client::JobSlots& slots) {
    for (GroupJobOutcome& out : group_->TakeLeft()) {
      auto it = members_.find(out.index);
      if (it == members_.end()) continue;
      const std::shared_ptr<const client::JobContext> ctx = it->second;
      members_.erase(it);
      if (out.error) {
        slots.Finish(*ctx, client::FailedResult(out.error, ctx->assignment));
        continue;
      }
      const TrainResult& r = out.result;
      client::JobResult result;
      result.final_step = r.steps_done;
      if (!r.checkpoint_dir.empty()) ctx->report_checkpoint(r.steps_done, r.checkpoint_dir);
      if (r.stopped) {
        result.kind = client::JobResult::Kind::kStopped;
        result.adapter_path = r.checkpoint_dir;  // the adapter as of the stop, in its checkpoint
      } else {
        result.kind = client::JobResult::Kind::kCompleted;
        result.adapter_path = r.adapter_dir;
      }
      slots.Finish(*ctx, result);
    }
  }

  const TrainOptions& train_;
  const OfferedStores& stores_;
  const std::atomic<bool>* hold_;
  std::deque<Job> pending_;
  std::unique_ptr<GroupTrainer> group_;
  JobSpec group_first_;                          // the spec the group was built from
  std::optional<UserIdentity> group_submitter_;  // its first job's submitter
  const UserIdentity* group_files_as_ = nullptr;
  std::map<size_t, std::shared_ptr<const client::JobContext>> members_;  // by GroupTrainer index
};

}  // namespace

int RunServe(const ServeOptions& options, const std::atomic<bool>& stop) {
  // Before anything else: a default endpoint whose folder is another user's is refused.
  if (std::string why = client::EndpointDirProblem(options.coordinator); !why.empty())
    throw Error(ErrorCode::kRefused, "not connecting to " + options.coordinator + ": " + why);
  client::WorkerAgentOptions agent_options;
  agent_options.client.endpoint = options.coordinator;
  agent_options.client.curve_keys_dir = options.curve_keys;
  agent_options.client.timeout_ms = static_cast<int>(options.request_timeout_s * 1000);
  agent_options.device = options.device;
  DescribeDevice(options.device, &agent_options);
  if (options.jobs > 0) {
    agent_options.slots = options.jobs;
    LS_LOG_INFO("job slots: {} (--jobs)", agent_options.slots);
  } else {
    agent_options.slots = DefaultJobSlots(agent_options.gpu_memory_bytes);
    if (agent_options.gpu_memory_bytes == 0)
      LS_LOG_INFO("job slots: 1 (the CPU trains one job at a time; --jobs K sets more)");
    else
      LS_LOG_INFO("job slots: {} ({} has {}: one per {} GiB, at most {}; --jobs K sets another)",
                  agent_options.slots, options.device, FormatBytes(agent_options.gpu_memory_bytes),
                  kGiBPerJobSlot, kMaxDefaultJobSlots);
  }
  const OfferedStores stores = DiscoverStores(options);
  agent_options.stores = stores.infos;

  TrainOptions train;
  train.device = options.device;
  train.resume = true;  // a requeued job continues from its output folder's checkpoint
  train.threads = options.threads;
  if (options.stream)
    train.make_provider = [](const JobSpec& spec, const BaseWeights& base,
                             const std::string& device, const std::string& dtype,
                             const std::vector<JobSpec>& group) {
      return MakeStreamProvider(spec, base, device, dtype, {}, group);
    };

  GroupRunner group(train, stores, options.hold_at_checkpoint);
  client::WorkerAgent agent(agent_options, [&group](client::JobSlots& slots) { group.Run(slots); });
  int jobs = agent.Run(stop);
  LS_LOG_INFO("worker stopping after {} jobs", jobs);
  return 0;
}

}  // namespace lorastream::worker
