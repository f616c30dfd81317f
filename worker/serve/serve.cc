#include "worker/serve/serve.h"

#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <map>
#include <optional>
#include <thread>
#include <vector>

#include "common/device.h"
#include "common/error.h"
#include "common/job_access.h"
#include "common/log.h"
#include "common/shm_names.h"
#include "coordinator/curve.h"
#include "coordinator/worker_agent.h"
#include "store/attach.h"
#include "store/registry.h"
#include "worker/stream/stream_provider.h"
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
  OfferedStores out;
  for (const StoreOffer& offer : offers) {
    if (!out.local_name.emplace(offer.offered_as, offer.name).second)
      throw Error(ErrorCode::kInvalidArgument,
                  "two stores are offered as '" + offer.offered_as + "' (--store)");
    store::AttachedStore store =
        store::AttachedStore::AttachWhenReady(offer.name, options.store_wait_s);
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

  const std::atomic<bool>* hold = options.hold_at_checkpoint;
  client::JobRunner runner = [&train, &stores, hold](const client::JobContext& ctx) {
    JobSpec spec = ctx.assignment.spec;
    spec.model.store = stores.Local(spec.model.store);
    // Another user's job on a root worker: its files are opened and created as that user
    // (common/acting_as.h), never handed over afterwards.
    const std::optional<UserIdentity> submitter = SubmitterToServe(ctx.assignment);
    TrainOptions job_train = train;
    if (submitter && ::geteuid() == 0) job_train.files_as = &*submitter;
    job_train.lock_holder = AttemptHolder(ctx.assignment.job_id, ctx.assignment.attempt,
                                          "lorastream-worker pid " + std::to_string(::getpid()));
    const int64_t every = spec.train.checkpoint_every;
    auto checkpoint_dir = [&](int64_t step) {
      return (std::filesystem::path(spec.train.output_dir) / ("checkpoint-" + std::to_string(step)))
          .string();
    };
    // The trainer saves checkpoint N right after on_step(N) returns, so step N + 1 is the
    // first moment checkpoint N is known to exist.
    auto on_step = [&](const StepStats& stats) {
      ctx.report_step(stats);
      int64_t previous = stats.step - 1;
      if (every > 0 && previous > 0 && previous % every == 0) {
        ctx.report_checkpoint(previous, checkpoint_dir(previous));
        if (hold != nullptr && *hold) HoldAtCheckpoint(*hold, ctx, previous);
      }
    };
    TrainResult r = RunTraining(spec, job_train, on_step, ctx.should_stop);
    client::JobResult result;
    result.final_step = r.steps_done;
    if (!r.checkpoint_dir.empty()) ctx.report_checkpoint(r.steps_done, r.checkpoint_dir);
    if (r.stopped) {
      result.kind = client::JobResult::Kind::kStopped;
      result.adapter_path = r.checkpoint_dir;  // the adapter as of the stop, in its checkpoint
    } else {
      result.kind = client::JobResult::Kind::kCompleted;
      result.adapter_path = r.adapter_dir;
    }
    return result;
  };

  client::WorkerAgent agent(agent_options, runner);
  int jobs = agent.Run(stop);
  LS_LOG_INFO("worker stopping after {} jobs", jobs);
  return 0;
}

}  // namespace lorastream::worker
