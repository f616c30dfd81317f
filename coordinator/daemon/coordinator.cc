#include "coordinator/daemon/coordinator.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <utility>

#include <unistd.h>

#include "common/base/log.h"
#include "common/job/job_group.h"
#include "common/posix/user_access.h"

namespace lorastream::coordinator {
namespace {

// The weight of each new step in the moving average of the step time (the ETA).
constexpr double kStepRateEmaWeight = 0.2;

bool Fits(const JobRecord& job, const WorkerEntry& worker) {
  const JobSummary& s = job.summary;
  // A job on a checkpoint folder (no store) reads it directly: any worker may take it.
  return s.store_name.empty() || worker.HasStore(s.store_name, s.fingerprint);
}

std::string Describe(const WorkerEntry& w) {
  return w.id + " (" + w.info.host + " " + w.info.device + ")";
}

}  // namespace

Submitter CurrentSubmitter() {
  Submitter me;
  me.uid = ::geteuid();
  try {
    me.name = LookupUser(static_cast<uid_t>(me.uid)).name;
  } catch (const Error&) {
    me.name = "uid " + std::to_string(me.uid);
  }
  return me;
}

double WallSeconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

Coordinator::Coordinator(CoordinatorOptions options, Journal journal, double now)
    : options_(std::move(options)), journal_(std::move(journal)) {
  LS_CHECK(static_cast<bool>(options_.validator), "coordinator needs a job validator");
  if (options_.reconcile_timeout_s < 0) options_.reconcile_timeout_s = options_.heartbeat_timeout_s;
  reconcile_deadline_ = now + options_.reconcile_timeout_s;
  int running = 0;
  // A row the journal skipped keeps its id: a new job never replaces it.
  next_job_id_ = std::max(next_job_id_, journal_.MaxJobId() + 1);
  for (JobRecord& job : journal_.LoadJobs()) {
    int64_t id = job.summary.id;
    next_job_id_ = std::max(next_job_id_, id + 1);
    if (job.summary.submitter_uid < 0) {  // from a journal older than submitters
      job.summary.submitter_uid = options_.operator_user.uid;
      job.summary.submitter = options_.operator_user.name;
    }
    if (job.summary.state == JobState::kQueued) queue_.Push(id, job.summary.priority);
    if (job.summary.state == JobState::kRunning) ++running;
    // The evaluations are not columns of the job: take them from its statistics.
    for (const StepStats& x : journal_.LoadStats(id)) job.summary.NoteEval(x);
    jobs_.emplace(id, std::move(job));
  }
  if (!jobs_.empty())
    LS_LOG_INFO("journal: {} jobs loaded ({} queued, {} running awaiting their workers)",
                jobs_.size(), queue_.size(), running);
}

JobRecord& Coordinator::FindJob(int64_t id) {
  auto it = jobs_.find(id);
  if (it == jobs_.end()) throw Error(ErrorCode::kNotFound, "no job " + std::to_string(id));
  return it->second;
}

const JobRecord& Coordinator::FindJob(int64_t id) const {
  return const_cast<Coordinator*>(this)->FindJob(id);
}

void Coordinator::Save(const JobRecord& job) { journal_.SaveJob(job); }

RegisterReply Coordinator::Register(const RegisterRequest& req, double now) {
  if (req.host.empty() || req.device.empty())
    throw Error(ErrorCode::kInvalidArgument, "Register: host and device must be named");
  if (req.slots < 1)
    throw Error(
        ErrorCode::kInvalidArgument,
        "Register: a worker has at least one job slot (found " + std::to_string(req.slots) + ")");
  RegisterReply reply;
  reply.heartbeat_interval_s = options_.heartbeat_interval_s;
  // The running jobs the worker names that its old identity owned in that very attempt.
  std::vector<RunningJob> kept;
  if (!req.previous_worker_id.empty()) {
    for (const RunningJob& r : req.running) {
      auto it = jobs_.find(r.job_id);
      if (it != jobs_.end() && it->second.summary.state == JobState::kRunning &&
          it->second.summary.worker_id == req.previous_worker_id &&
          it->second.summary.attempt == r.attempt)
        kept.push_back(r);
    }
    // Whatever else the old identity owned must run elsewhere.
    auto is_kept = [&](int64_t id) {
      return std::any_of(kept.begin(), kept.end(),
                         [&](const RunningJob& r) { return r.job_id == id; });
    };
    for (auto& [id, job] : jobs_)
      if (job.summary.state == JobState::kRunning &&
          job.summary.worker_id == req.previous_worker_id && !is_kept(id))
        Requeue(job, "worker " + req.previous_worker_id + " re-registered without it", false);
    if (WorkerEntry* old = workers_.FindAlive(req.previous_worker_id)) old->alive = false;
  }
  WorkerEntry& w = workers_.Add(kept.empty() ? NewWorkerId() : req.previous_worker_id, req, now);
  w.jobs = kept;
  reply.worker_id = w.id;
  for (const RunningJob& r : kept) reply.kept_jobs.push_back(r.job_id);
  if (!kept.empty())
    LS_LOG_INFO("worker {} re-registered; keeps {} of its {} jobs", Describe(w), kept.size(),
                req.running.size());
  else
    LS_LOG_INFO("worker {} registered ({} slots, {} stores, gpu '{}')", Describe(w), w.slots(),
                req.stores.size(), req.gpu_name);
  Touch();
  return reply;
}

JobAssignment Coordinator::Assign(JobRecord& job, WorkerEntry& worker) {
  JobSummary& s = job.summary;
  queue_.Remove(s.id, s.priority);
  s.state = JobState::kRunning;
  s.attempt += 1;
  s.worker_id = worker.id;
  s.worker_host = worker.info.host;
  s.worker_device = worker.info.device;
  if (s.started_at == 0) s.started_at = WallSeconds();
  // Pin the base model's fingerprint at the first run: a resumed adapter must continue on
  // the same weights.
  if (s.fingerprint.empty() && !s.store_name.empty())
    s.fingerprint = worker.FingerprintOf(s.store_name);
  worker.jobs.push_back(RunningJob{s.id, s.attempt});
  if (drain_job_ == s.id) {
    drain_job_ = 0;
    drain_worker_.clear();
  }
  Save(job);
  Touch();
  LS_LOG_INFO("job {} '{}' attempt {} -> worker {}, slot {}/{} (resume from step {})", s.id, s.name,
              s.attempt, Describe(worker), worker.jobs.size(), worker.slots(), s.checkpoint_step);
  return AssignmentOf(job);
}

std::string Coordinator::GroupProblem(const JobRecord& job, const WorkerEntry& worker) const {
  for (const RunningJob& r : worker.jobs) {
    auto it = jobs_.find(r.job_id);
    if (it == jobs_.end()) continue;
    const JobRecord& other = it->second;
    std::string why = GroupRefusal(other.spec, job.spec, worker.info.device);
    if (!why.empty()) return why;
    // A root worker (or one that did not say) acts as each job's submitter, and its group's
    // one training thread acts as one user at a time.
    if (worker.info.uid <= 0 && other.summary.submitter_uid != job.summary.submitter_uid)
      return "job " + job.spec.name + " cannot train in a group with job " + other.spec.name +
             ": another submitter (" + job.summary.submitter + ", " + other.summary.submitter +
             "), and the group's thread acts as one user";
  }
  return "";
}

void Coordinator::UpdateDrain() {
  // The head of the queue: the first job some live worker has the base of.
  auto candidate = [&](const JobRecord& job, const WorkerEntry& w) {
    return w.alive && Fits(job, w);
  };
  const int64_t head = queue_.PickFirst([&](int64_t id) {
    const JobRecord& job = jobs_.at(id);
    for (const WorkerEntry* w : workers_.Alive())
      if (candidate(job, *w)) return true;
    return false;
  });
  std::string chosen;
  if (head != 0) {
    const JobRecord& job = jobs_.at(head);
    const WorkerEntry* fewest = nullptr;
    bool compatible = false, previous = false;
    for (const WorkerEntry* w : workers_.Alive()) {
      if (!candidate(job, *w)) continue;
      if (GroupProblem(job, *w).empty()) {
        compatible = true;  // it waits for (or takes) a slot there
        break;
      }
      if (w->id == drain_worker_ && drain_job_ == head) previous = true;
      if (!fewest || w->jobs.size() < fewest->jobs.size()) fewest = w;
    }
    if (!compatible) chosen = previous ? drain_worker_ : fewest->id;
  }
  if (chosen.empty()) {
    drain_job_ = 0;
    drain_worker_.clear();
    return;
  }
  if (chosen != drain_worker_ || head != drain_job_)
    LS_LOG_INFO(
        "job {} fits no running group ({}): worker {} takes no other job until its group has "
        "drained",
        head, GroupProblem(jobs_.at(head), *workers_.FindAlive(chosen)), chosen);
  drain_job_ = head;
  drain_worker_ = chosen;
}

int64_t Coordinator::PickFor(const WorkerEntry& worker) {
  UpdateDrain();
  if (worker.id == drain_worker_) return worker.jobs.empty() ? drain_job_ : 0;
  return queue_.PickFirst([&](int64_t id) {
    const JobRecord& job = jobs_.at(id);
    return Fits(job, worker) && GroupProblem(job, worker).empty();
  });
}

JobAssignment Coordinator::AssignmentOf(const JobRecord& job) {
  const JobSummary& s = job.summary;
  JobAssignment a;
  a.job_id = s.id;
  a.attempt = s.attempt;
  a.spec = job.spec;
  a.resume_step = s.checkpoint_step;
  a.checkpoint_path = s.checkpoint_path;
  a.submitter_uid = s.submitter_uid;
  a.submitter = s.submitter;
  return a;
}

HeartbeatReply Coordinator::Heartbeat(const HeartbeatRequest& req, double now) {
  HeartbeatReply reply;
  WorkerEntry* w = workers_.FindAlive(req.worker_id);
  if (!w) {
    reply.known_worker = false;
    return reply;
  }
  w->last_seen = now;
  for (const RunningJob& r : req.running) {
    auto it = jobs_.find(r.job_id);
    bool owned = it != jobs_.end() && it->second.summary.state == JobState::kRunning &&
                 it->second.summary.worker_id == w->id && it->second.summary.attempt == r.attempt;
    if (!owned || it->second.summary.cancel_requested) reply.stop_jobs.push_back(r.job_id);
  }
  for (const RunningJob& mine : std::vector<RunningJob>(w->jobs)) {
    const bool named = std::any_of(req.running.begin(), req.running.end(),
                                   [&](const RunningJob& r) { return r.job_id == mine.job_id; });
    if (named) continue;
    // The registry says this worker runs a job it does not name: the reply carrying the
    // assignment was lost. Send the same attempt again rather than leave the job running on
    // nobody.
    JobRecord& job = FindJob(mine.job_id);
    if (job.summary.state == JobState::kRunning && job.summary.worker_id == w->id &&
        job.summary.attempt == mine.attempt) {
      reply.has_assignment = true;
      reply.assignment = AssignmentOf(job);
      return reply;
    }
    w->Drop(mine.job_id);
  }
  if (req.free_slots <= 0 || w->free_slots() <= 0) return reply;
  const int64_t id = PickFor(*w);
  if (id != 0) {
    reply.has_assignment = true;
    reply.assignment = Assign(jobs_.at(id), *w);
  }
  return reply;
}

JobRecord& Coordinator::RequireOwner(const std::string& worker_id, int64_t job_id, int32_t attempt,
                                     double now) {
  WorkerEntry* w = workers_.FindAlive(worker_id);
  if (!w)
    throw Error(ErrorCode::kNotFound,  // the agent registers again on this code
                "unknown or dead worker '" + worker_id + "': register again");
  w->last_seen = now;
  auto it = jobs_.find(job_id);
  if (it == jobs_.end())
    throw Error(ErrorCode::kRefused, "worker " + worker_id + " reports on job " +
                                         std::to_string(job_id) + ", which does not exist");
  const JobSummary& s = it->second.summary;
  if (s.state != JobState::kRunning || s.worker_id != worker_id || s.attempt != attempt)
    throw Error(ErrorCode::kRefused,
                "worker " + worker_id + " does not run job " + std::to_string(job_id) +
                    " attempt " + std::to_string(attempt) + " (the job is " +
                    JobStateName(s.state) + (s.worker_id.empty() ? "" : " on " + s.worker_id) +
                    ", attempt " + std::to_string(s.attempt) + ")");
  return it->second;
}

WorkerAck Coordinator::Step(const StepReport& req, double now) {
  JobRecord& job = RequireOwner(req.worker_id, req.job_id, req.attempt, now);
  JobSummary& s = job.summary;
  const StepStats& x = req.stats;
  s.step = x.step;
  if (x.total_steps > 0) s.total_steps = x.total_steps;
  s.last_stats = x;
  s.has_stats = true;
  s.NoteEval(x);
  if (x.step_seconds > 0) {
    // The first step of an attempt carries its start-up (allocation, calibration, a CUDA
    // graph's capture): the second replaces it outright; later steps weigh 0.2.
    StepRateEma& e = step_seconds_ema_[s.id];
    const double w = e.samples <= 1 ? 1.0 : kStepRateEmaWeight;
    e.step_seconds = w * x.step_seconds + (1 - w) * e.step_seconds;
    ++e.samples;
  }
  // Downsampling: about stats_rows_per_job rows per job, always the first and the last step
  // and every step that evaluated.
  int64_t stride = std::max<int64_t>(1, s.total_steps / std::max(1, options_.stats_rows_per_job));
  if (x.step % stride == 0 || x.step == 1 || x.step == s.total_steps || x.has_eval()) {
    journal_.AppendStats(s.id, s.attempt, x);
    Save(job);
  }
  if (options_.on_stats) {
    try {
      options_.on_stats(s, x);
    } catch (const std::exception& e) {
      LS_LOG_WARN("job {}: statistics sink failed: {}", s.id, e.what());
    }
  }
  Touch();
  WorkerAck ack;
  ack.stop_job = s.cancel_requested;
  return ack;
}

WorkerAck Coordinator::Checkpoint(const CheckpointReport& req, double now) {
  JobRecord& job = RequireOwner(req.worker_id, req.job_id, req.attempt, now);
  job.summary.checkpoint_step = req.step;
  job.summary.checkpoint_path = req.path;
  Save(job);
  Touch();
  WorkerAck ack;
  ack.stop_job = job.summary.cancel_requested;
  return ack;
}

WorkerAck Coordinator::Finished(const JobFinished& req, double now) {
  JobRecord& job = RequireOwner(req.worker_id, req.job_id, req.attempt, now);
  JobSummary& s = job.summary;
  if (req.final_step > 0) s.step = req.final_step;
  if (!req.adapter_path.empty()) s.adapter_path = req.adapter_path;
  std::string at = " at step " + std::to_string(s.step);
  switch (req.outcome) {
    case JobOutcome::kSucceeded:
      Finish(job, JobState::kSucceeded, "", WallSeconds());
      break;
    case JobOutcome::kFailed:
      Finish(job, JobState::kFailed, req.reason.empty() ? "failed" + at : req.reason,
             WallSeconds());
      break;
    case JobOutcome::kCancelled:
      if (s.cancel_requested)
        Finish(job, JobState::kCancelled,
               "cancelled" + at + (s.adapter_path.empty() ? "" : "; adapter in " + s.adapter_path),
               WallSeconds());
      else
        Finish(job, JobState::kFailed, "the worker stopped the job" + at + ": " + req.reason,
               WallSeconds());
      break;
    case JobOutcome::kInterrupted:
      if (s.cancel_requested)
        Finish(job, JobState::kCancelled, "cancelled" + at, WallSeconds());
      else
        Requeue(job, "worker " + req.worker_id + " shut down" + at, false);
      break;
  }
  return WorkerAck{};
}

void Coordinator::DetachWorker(const JobSummary& job) {
  if (job.worker_id.empty()) return;
  if (WorkerEntry* w = workers_.FindAlive(job.worker_id)) w->Drop(job.id);
}

void Coordinator::Finish(JobRecord& job, JobState state, const std::string& reason,
                         double wall_now) {
  JobSummary& s = job.summary;
  if (s.state == JobState::kQueued) queue_.Remove(s.id, s.priority);
  DetachWorker(s);
  s.state = state;
  s.reason = reason;
  s.finished_at = wall_now;
  step_seconds_ema_.erase(s.id);
  Save(job);
  Touch();
  LS_LOG_INFO("job {} '{}' {}{}{}", s.id, s.name, JobStateName(state), reason.empty() ? "" : ": ",
              reason);
}

void Coordinator::Requeue(JobRecord& job, const std::string& why, bool count_retry) {
  JobSummary& s = job.summary;
  if (s.cancel_requested) {
    Finish(job, JobState::kCancelled, "cancelled; " + why, WallSeconds());
    return;
  }
  if (count_retry && ++job.retries > options_.max_retries) {
    Finish(job, JobState::kFailed,
           why + "; gave up after " + std::to_string(options_.max_retries) + " retries",
           WallSeconds());
    return;
  }
  DetachWorker(s);
  s.state = JobState::kQueued;
  s.reason = why + "; requeued, resumes from step " + std::to_string(s.checkpoint_step);
  s.worker_id.clear();
  s.worker_host.clear();
  s.worker_device.clear();
  step_seconds_ema_.erase(s.id);
  queue_.Push(s.id, s.priority);
  Save(job);
  Touch();
  LS_LOG_WARN("job {} '{}': {}", s.id, s.name, s.reason);
}

SubmitReply Coordinator::Submit(const SubmitRequest& req, const std::string& client_key,
                                const Submitter& submitter) {
  SubmitReply reply;
  reply.problems = options_.validator(req.spec);
  const JobSpec& spec = req.spec;
  if (spec.priority < std::numeric_limits<int32_t>::min() ||
      spec.priority > std::numeric_limits<int32_t>::max())
    reply.problems.push_back(spec.source + ": key `priority` is out of range (found " +
                             std::to_string(spec.priority) + ")");
  // Two live jobs writing one output folder would resume from each other's checkpoints and
  // overwrite each other's adapter. Compared by canonical path, resolved now (a folder or
  // link created since the other job's submission counts).
  if (!spec.train.output_dir.empty()) {
    const std::string mine = CanonicalPath(spec.train.output_dir);
    for (const auto& [id, other] : jobs_)
      if (!IsTerminal(other.summary.state) && !other.summary.output_dir.empty() &&
          CanonicalPath(other.summary.output_dir) == mine)
        reply.problems.push_back(spec.source + ": key `train.output_dir` (" +
                                 spec.train.output_dir +
                                 (mine == spec.train.output_dir ? "" : ", which is " + mine) +
                                 ") is already used by job " + std::to_string(id) + ", which is " +
                                 JobStateName(other.summary.state));
  }
  if (const std::string why = Journal::RecordProblem(spec); !why.empty())
    reply.problems.push_back(spec.source + ": the job cannot be kept as it was sent: " + why);
  if (!reply.problems.empty()) return reply;
  JobRecord job;
  JobSummary& s = job.summary;
  s.id = next_job_id_++;
  s.name = spec.name;
  s.priority = static_cast<int32_t>(spec.priority);
  s.store_name = spec.model.store;
  s.spec_source = spec.source;
  s.output_dir = spec.train.output_dir;
  s.total_steps = spec.train.steps;
  s.submitted_at = WallSeconds();
  s.state = JobState::kQueued;
  job.spec = spec;
  job.spec_toml = req.spec_toml;
  job.owner = client_key;
  const Submitter& who = submitter.uid >= 0 ? submitter : options_.operator_user;
  s.submitter_uid = who.uid;
  s.submitter = who.name;
  Save(job);
  queue_.Push(s.id, s.priority);
  reply.job_id = s.id;
  LS_LOG_INFO("job {} '{}' submitted by {} (uid {}; priority {}, store '{}')", s.id, s.name,
              s.submitter, s.submitter_uid, s.priority, s.store_name);
  jobs_.emplace(reply.job_id, std::move(job));
  Touch();
  return reply;
}

JobSummary Coordinator::View(const JobRecord& job) const {
  JobSummary s = job.summary;
  auto it = step_seconds_ema_.find(s.id);
  if (s.state == JobState::kRunning && it != step_seconds_ema_.end() && s.total_steps > 0)
    s.eta_seconds = std::max<int64_t>(0, s.total_steps - s.step) * it->second.step_seconds;
  // A queued job that no live worker can take says why (its store offered nowhere, or with
  // other weights than its first run's); a requeued one keeps its own reason.
  if (s.state == JobState::kQueued && s.reason.empty() && !s.store_name.empty()) {
    const auto alive = workers_.Alive();
    if (std::none_of(alive.begin(), alive.end(),
                     [&](const WorkerEntry* w) { return Fits(job, *w); }))
      s.reason = "waiting for a worker offering store `" + s.store_name + "`" +
                 (s.fingerprint.empty() ? "" : " with fingerprint " + s.fingerprint);
  }
  return s;
}

bool Coordinator::IsOperator(const Submitter& viewer) const {
  return viewer.uid < 0 || viewer.uid == 0 || viewer.uid == options_.operator_user.uid;
}

bool Coordinator::MaySee(const Submitter& viewer, const JobRecord& job) const {
  return IsOperator(viewer) || job.summary.submitter_uid == viewer.uid;
}

const JobRecord& Coordinator::FindVisibleJob(int64_t id, const Submitter& viewer) const {
  const JobRecord& job = FindJob(id);
  if (!MaySee(viewer, job))
    throw Error(ErrorCode::kRefused, "job " + std::to_string(id) +
                                         " was submitted by another user; " + viewer.name +
                                         " sees only its own jobs");
  return job;
}

ListJobsReply Coordinator::ListJobs(const ListJobsRequest& req, double now,
                                    const Submitter& viewer) const {
  ListJobsReply reply;
  for (const auto& [id, job] : jobs_)
    if ((req.include_finished || !IsTerminal(job.summary.state)) && MaySee(viewer, job))
      reply.jobs.push_back(View(job));
  return reply;
}

ShowJobReply Coordinator::ShowJob(const ShowJobRequest& req, double now,
                                  const Submitter& viewer) const {
  const JobRecord& job = FindVisibleJob(req.job_id, viewer);
  ShowJobReply reply;
  reply.job = View(job);
  reply.spec_toml = job.spec_toml;
  reply.retries = job.retries;
  return reply;
}

StatsReply Coordinator::Stats(const StatsRequest& req, const Submitter& viewer) const {
  const JobRecord& job = FindVisibleJob(req.job_id, viewer);
  StatsReply reply;
  reply.job_id = req.job_id;
  reply.stats = journal_.LoadStats(req.job_id);
  const JobSummary& s = job.summary;
  if (s.has_stats && (reply.stats.empty() || reply.stats.back().step < s.last_stats.step))
    reply.stats.push_back(s.last_stats);
  return reply;
}

CancelReply Coordinator::Cancel(const CancelRequest& req, const std::string& client_key) {
  JobRecord& job = FindJob(req.job_id);
  JobSummary& s = job.summary;
  // Without a key the request came from a coordinator without CURVE (loopback: everyone on
  // the host is trusted), which is also how an operator cancels a job whose key is gone.
  if (!job.owner.empty() && !client_key.empty() && client_key != job.owner)
    throw Error(ErrorCode::kRefused, "job " + std::to_string(s.id) +
                                         " was submitted with another client key; only that "
                                         "key can cancel it");
  CancelReply reply;
  if (IsTerminal(s.state))
    throw Error(ErrorCode::kInvalidArgument,
                "job " + std::to_string(s.id) + " already " + JobStateName(s.state));
  if (s.state == JobState::kQueued) {
    s.cancel_requested = true;
    Finish(job, JobState::kCancelled, "cancelled while queued", WallSeconds());
  } else {
    // The worker hears it in its next step report or heartbeat reply, saves the adapter at
    // the step boundary and reports the job cancelled.
    s.cancel_requested = true;
    Save(job);
    Touch();
    LS_LOG_INFO("job {} '{}': cancel requested", s.id, s.name);
  }
  reply.state = s.state;
  return reply;
}

ListWorkersReply Coordinator::ListWorkers(const ListWorkersRequest& req, double now) const {
  ListWorkersReply reply;
  reply.workers = workers_.Summaries(now, req.include_dead);
  return reply;
}

WatchReply Coordinator::Watch(const WatchRequest& req, double now, const Submitter& viewer) const {
  WatchReply reply;
  reply.version = version_;
  if (req.job_ids.empty()) {
    for (const auto& [id, job] : jobs_)
      if (MaySee(viewer, job)) reply.jobs.push_back(View(job));
  } else {
    for (int64_t id : req.job_ids) reply.jobs.push_back(View(FindVisibleJob(id, viewer)));
  }
  reply.workers = workers_.Summaries(now, false);
  return reply;
}

void Coordinator::Tick(double now) {
  for (WorkerEntry* w : workers_.Expired(now, options_.heartbeat_timeout_s)) {
    w->alive = false;
    Touch();
    LS_LOG_WARN("worker {} missed heartbeats for {:.1f} s: dead", Describe(*w), now - w->last_seen);
    // Every job of its slots resumes elsewhere from its own last checkpoint.
    const std::vector<RunningJob> jobs = std::exchange(w->jobs, {});
    for (const RunningJob& r : jobs) {
      JobRecord& job = FindJob(r.job_id);
      if (job.summary.state == JobState::kRunning && job.summary.worker_id == w->id)
        Requeue(job,
                "worker " + Describe(*w) + " died (no heartbeat for " +
                    std::to_string(static_cast<int>(options_.heartbeat_timeout_s)) + " s)",
                true);
    }
  }
  if (now >= reconcile_deadline_) {
    // Running jobs from the journal whose worker never came back after a restart.
    for (auto& [id, job] : jobs_) {
      const JobSummary& s = job.summary;
      if (s.state == JobState::kRunning && !workers_.FindAlive(s.worker_id))
        Requeue(job, "worker " + s.worker_id + " did not come back after a coordinator restart",
                true);
    }
    reconcile_deadline_ = std::numeric_limits<double>::infinity();
  }
  workers_.Prune(64);
}

}  // namespace lorastream::coordinator
