// The coordinator's logic, free of sockets so that it can be tested directly: one handler per
// request type, each returning the reply or throwing Error (which the server turns into an
// ErrorReply). Time is passed in (steady seconds) so timeouts are testable. Not thread-safe:
// the server calls it from its single loop thread.
//
// Job states: queued -> running -> succeeded | failed | cancelled. A running job is owned by
// exactly one (worker id, attempt); reports from anyone else are refused. A job whose worker
// dies, or whose worker does not re-register after a coordinator restart, is requeued with
// attempt + 1 and resumes from its last checkpoint, at most max_retries times; a worker's
// death requeues every job of its slots.
//
// Scheduling: a worker trains up to `slots` jobs at once as one job group. A free slot takes
// the first queued job (priority, then submission) whose store the worker has and that may
// share the group with every job it runs (common/job/job_group.h; on a root worker also the same
// submitter). When the head of the queue fits no live worker's group, the worker with the
// fewest jobs among those that have its store takes no other job until its group has drained,
// and then takes it: no job starves behind jobs that keep a group busy.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "common/protocol/messages.h"
#include "coordinator/daemon/job_record.h"
#include "coordinator/daemon/journal.h"
#include "coordinator/daemon/registry.h"
#include "coordinator/daemon/scheduler.h"

namespace lorastream::coordinator {

// Every problem that stops a job from running (empty: it can run). The product uses
// ValidateJobSpec (common/job/job_spec.h).
using JobValidator = std::function<std::vector<std::string>(const JobSpec&)>;

struct CoordinatorOptions {
  double heartbeat_interval_s = 1.0;  // what workers are told to use
  double heartbeat_timeout_s = 5.0;   // silence after which a worker is dead
  int max_retries = 3;                // requeues after worker deaths before a job fails
  // After a restart, how long running jobs wait for their worker to re-register before they
  // are requeued; < 0: heartbeat_timeout_s.
  double reconcile_timeout_s = -1;
  int stats_rows_per_job = 2000;  // downsampling target of the journal's statistics
  JobValidator validator;         // required
  // Whom a job is attributed to when its submitter is unknown (journals written before jobs
  // recorded one): the coordinator's own user.
  Submitter operator_user = CurrentSubmitter();
  // Called with every step report as it arrives (after the job's summary took it): the
  // TensorBoard writer hangs here. Exceptions it throws are logged, never answered.
  std::function<void(const JobSummary& job, const StepStats& stats)> on_stats;
};

class Coordinator {
 public:
  // Loads every job from the journal; running ones wait for their workers (reconcile).
  Coordinator(CoordinatorOptions options, Journal journal, double now);

  RegisterReply Register(const RegisterRequest& req, double now);
  HeartbeatReply Heartbeat(const HeartbeatRequest& req, double now);
  WorkerAck Step(const StepReport& req, double now);
  WorkerAck Checkpoint(const CheckpointReport& req, double now);
  WorkerAck Finished(const JobFinished& req, double now);

  // `client_key`: the requesting client's CURVE public key (Z85), "" without CURVE. Under
  // CURVE a job submitted with a key can be cancelled only with the same key (kRefused
  // otherwise); a coordinator without CURVE (loopback) lets anyone on the host cancel.
  // `submitter`: the local user the request comes from (uid -1: options.operator_user). A
  // job is refused when another live job writes the same output folder, compared by
  // canonical path (CanonicalPath: "/x/dd", "/x/dd/", "/x/./dd" and a link to it are one).
  SubmitReply Submit(const SubmitRequest& req, const std::string& client_key = "",
                     const Submitter& submitter = {});
  // `viewer`: who asks (uid -1: the operator). A user sees only the jobs it submitted; the
  // operator (the coordinator's own user, root, or a CURVE key mapped to no user) sees
  // every job. Another user's job is refused (kRefused) as if it were not there to see.
  ListJobsReply ListJobs(const ListJobsRequest& req, double now,
                         const Submitter& viewer = {}) const;
  ShowJobReply ShowJob(const ShowJobRequest& req, double now, const Submitter& viewer = {}) const;
  StatsReply Stats(const StatsRequest& req, const Submitter& viewer = {}) const;
  CancelReply Cancel(const CancelRequest& req, const std::string& client_key = "");
  ListWorkersReply ListWorkers(const ListWorkersRequest& req, double now) const;
  WatchReply Watch(const WatchRequest& req, double now, const Submitter& viewer = {}) const;

  // Declares silent workers dead and requeues their jobs; requeues unreconciled jobs.
  void Tick(double now);

  // Bumped by every change a `watch` would show.
  uint64_t version() const { return version_; }

 private:
  JobRecord& FindJob(int64_t id);
  const JobRecord& FindJob(int64_t id) const;
  // The job `worker_id` reports on, when it owns that attempt; Error(kNotFound) for a worker
  // the coordinator does not know (it should register again), Error(kRefused) otherwise.
  JobRecord& RequireOwner(const std::string& worker_id, int64_t job_id, int32_t attempt,
                          double now);
  JobAssignment Assign(JobRecord& job, WorkerEntry& worker);
  // Why `job` cannot join the group `worker` trains ("" when it can).
  std::string GroupProblem(const JobRecord& job, const WorkerEntry& worker) const;
  // The queued job for a free slot of `worker` (0: none).
  int64_t PickFor(const WorkerEntry& worker);
  // Chooses the worker that drains for the head of the queue, when no group fits it.
  void UpdateDrain();
  static JobAssignment AssignmentOf(const JobRecord& job);
  void Requeue(JobRecord& job, const std::string& why, bool count_retry);
  void Finish(JobRecord& job, JobState state, const std::string& reason, double wall_now);
  void DetachWorker(const JobSummary& job);  // frees the job's slot on its worker
  JobSummary View(const JobRecord& job) const;
  bool IsOperator(const Submitter& viewer) const;
  bool MaySee(const Submitter& viewer, const JobRecord& job) const;
  // FindJob for `viewer`: Error(kRefused) for another user's job.
  const JobRecord& FindVisibleJob(int64_t id, const Submitter& viewer) const;
  void Save(const JobRecord& job);
  void Touch() { ++version_; }

  CoordinatorOptions options_;
  Journal journal_;
  WorkerRegistry workers_;
  std::map<int64_t, JobRecord> jobs_;
  JobQueue queue_;
  // Per running job: the exponential moving average of the step time, for the ETA (its first
  // sample, the start-up step, is replaced by the second: Coordinator::Step).
  struct StepRateEma {
    double step_seconds = 0;
    int samples = 0;
  };
  std::map<int64_t, StepRateEma> step_seconds_ema_;
  int64_t next_job_id_ = 1;
  double reconcile_deadline_ = 0;
  // The head of the queue that no group fits, and the worker draining for it ("": none).
  int64_t drain_job_ = 0;
  std::string drain_worker_;
  uint64_t version_ = 1;
};

double WallSeconds();

}  // namespace lorastream::coordinator
