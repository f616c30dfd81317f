// Every message of the coordinator protocol (DESIGN.md: ZeroMQ ROUTER on the coordinator,
// DEALER on workers and the `lorastream` command) and its cereal encoding inside the envelope.
//
// Each request type has exactly one reply type (MessageTraits<T>::Reply); any request may
// instead be answered by ErrorReply (code + message), which is how nothing crosses the wire
// as an exception. Workers hear about new jobs and cancellations in the replies to their
// heartbeats and reports (they poll), so the coordinator never sends unsolicited messages.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "common/base/error.h"
#include "common/job/job_spec.h"
#include "common/job/step_stats.h"
#include "common/protocol/envelope.h"
#include "common/protocol/message_archive.h"

namespace lorastream {

enum class MessageType : uint16_t {
  kError = 1,
  // worker -> coordinator
  kRegister = 10,
  kRegisterReply = 11,
  kHeartbeat = 12,
  kHeartbeatReply = 13,
  kStepReport = 14,
  kCheckpointReport = 15,
  kJobFinished = 16,
  kWorkerAck = 17,  // reply to the three reports above
  // command -> coordinator
  kSubmit = 30,
  kSubmitReply = 31,
  kListJobs = 32,
  kListJobsReply = 33,
  kShowJob = 34,
  kShowJobReply = 35,
  kStats = 36,
  kStatsReply = 37,
  kCancel = 38,
  kCancelReply = 39,
  kListWorkers = 40,
  kListWorkersReply = 41,
  kWatch = 42,
  kWatchReply = 43,
};

bool IsKnownMessageType(uint16_t type);
const char* MessageTypeName(uint16_t type);

enum class JobState : int32_t { kQueued = 0, kRunning, kSucceeded, kFailed, kCancelled };
const char* JobStateName(JobState state);
bool IsTerminal(JobState state);

struct ErrorReply {
  ErrorCode code = ErrorCode::kInternal;
  std::string message;
  template <class A>
  void serialize(A& ar) {
    SerializeEnum(ar, code, ErrorCode::kInternal);
    ar(message);
  }
};

// A store the worker's host can attach: the base model a job names must match one of these.
struct StoreInfo {
  std::string name;
  std::string fingerprint;
  template <class A>
  void serialize(A& ar) {
    ar(name, fingerprint);
  }
};

// A job a worker runs: which attempt of it.
struct RunningJob {
  int64_t job_id = 0;
  int32_t attempt = 0;
  template <class A>
  void serialize(A& ar) {
    ar(job_id, attempt);
  }
};

struct RegisterRequest {
  std::string host;
  std::string device;  // "cuda:0" or "cpu"
  std::string gpu_name;
  uint64_t gpu_memory_bytes = 0;
  int32_t pid = 0;
  std::vector<StoreInfo> stores;
  // Re-registration after a coordinator restart: the id this worker had and the jobs it is
  // still running. The coordinator keeps a job running only when its journal says that worker
  // ran that attempt.
  std::string previous_worker_id;
  std::vector<RunningJob> running;
  // How many jobs the worker trains at once (its job slots: one job group).
  int32_t slots = 1;
  // The worker's effective uid: a root worker acts as each job's submitter, and its group's
  // one training thread acts as one user, so its jobs share a group only with the same
  // submitter's. -1: unknown (taken as root).
  int64_t uid = -1;
  template <class A>
  void serialize(A& ar) {
    ar(host, device, gpu_name, gpu_memory_bytes, pid, stores, previous_worker_id, running, slots,
       uid);
  }
};

struct RegisterReply {
  std::string worker_id;  // the token every later message of this worker carries
  double heartbeat_interval_s = 1.0;
  // The running jobs the worker keeps; it stops every other one (they went elsewhere).
  std::vector<int64_t> kept_jobs;
  template <class A>
  void serialize(A& ar) {
    ar(worker_id, heartbeat_interval_s, kept_jobs);
  }
};

struct JobAssignment {
  int64_t job_id = 0;
  int32_t attempt = 0;      // 1 for the first run; each requeue adds one
  JobSpec spec;             // resolved (absolute paths) by the submitting command
  int64_t resume_step = 0;  // last checkpointed step (0: none); the trainer resumes from it
  std::string checkpoint_path;
  // Who submitted the job (README: Trust model). A worker whose effective uid differs opens
  // no path of the job that this user could not open, and gives the files it writes to them.
  int64_t submitter_uid = -1;  // -1: unknown (refused by a worker running as another user)
  std::string submitter;       // the user name on the coordinator's host
  template <class A>
  void serialize(A& ar) {
    ar(job_id, attempt, spec, resume_step, checkpoint_path, submitter_uid, submitter);
  }
};

struct HeartbeatRequest {
  std::string worker_id;
  std::vector<RunningJob> running;  // every job it runs (or has yet to report the end of)
  int32_t free_slots = 1;           // how many more jobs it takes now (0: none, e.g. stopping)
  template <class A>
  void serialize(A& ar) {
    ar(worker_id, running, free_slots);
  }
};

struct HeartbeatReply {
  bool known_worker = true;        // false: the coordinator does not know you (restarted): register
  std::vector<int64_t> stop_jobs;  // cancel requested, or the job is no longer yours
  bool has_assignment = false;
  JobAssignment assignment;  // valid when has_assignment (only into a free slot)
  template <class A>
  void serialize(A& ar) {
    ar(known_worker, stop_jobs, has_assignment, assignment);
  }
};

struct StepReport {
  std::string worker_id;
  int64_t job_id = 0;
  int32_t attempt = 0;
  StepStats stats;
  template <class A>
  void serialize(A& ar) {
    ar(worker_id, job_id, attempt, stats);
  }
};

struct CheckpointReport {
  std::string worker_id;
  int64_t job_id = 0;
  int32_t attempt = 0;
  int64_t step = 0;
  std::string path;
  template <class A>
  void serialize(A& ar) {
    ar(worker_id, job_id, attempt, step, path);
  }
};

// kInterrupted: the worker itself is shutting down; the job is requeued without counting a
// retry and resumes from its last checkpoint.
enum class JobOutcome : int32_t { kSucceeded = 0, kFailed, kCancelled, kInterrupted };

struct JobFinished {
  std::string worker_id;
  int64_t job_id = 0;
  int32_t attempt = 0;
  JobOutcome outcome = JobOutcome::kFailed;
  std::string reason;        // why it failed (or was stopped)
  std::string adapter_path;  // where the final adapter is
  int64_t final_step = 0;
  template <class A>
  void serialize(A& ar) {
    ar(worker_id, job_id, attempt);
    SerializeEnum(ar, outcome, JobOutcome::kInterrupted);
    ar(reason, adapter_path, final_step);
  }
};

struct WorkerAck {
  bool stop_job = false;  // stop at this step boundary (cancel, or the job is not yours)
  template <class A>
  void serialize(A& ar) {
    ar(stop_job);
  }
};

struct JobSummary {
  int64_t id = 0;
  std::string name;
  JobState state = JobState::kQueued;
  std::string reason;
  int32_t priority = 0;
  std::string store_name;
  std::string fingerprint;
  std::string spec_source;
  std::string output_dir;
  std::string adapter_path;
  std::string worker_id;
  std::string worker_host;
  std::string worker_device;
  int32_t attempt = 0;
  int64_t step = 0;
  int64_t total_steps = 0;
  int64_t checkpoint_step = 0;
  std::string checkpoint_path;
  bool cancel_requested = false;
  double submitted_at = 0;  // unix seconds
  double started_at = 0;
  double finished_at = 0;
  bool has_stats = false;
  StepStats last_stats;
  double eta_seconds = -1;     // < 0: unknown
  int64_t submitter_uid = -1;  // who submitted it (-1: unknown)
  std::string submitter;       // their user name
  // The newest and the lowest evaluation loss reported (steps 0 / NaN: none yet).
  int64_t last_eval_step = 0;
  double last_eval_loss = std::numeric_limits<double>::quiet_NaN();
  int64_t best_eval_step = 0;
  double best_eval_loss = std::numeric_limits<double>::quiet_NaN();
  template <class A>
  void serialize(A& ar) {
    ar(id, name);
    SerializeEnum(ar, state, JobState::kCancelled);
    ar(reason, priority, store_name, fingerprint, spec_source, output_dir, adapter_path, worker_id,
       worker_host, worker_device, attempt, step, total_steps, checkpoint_step, checkpoint_path,
       cancel_requested, submitted_at, started_at, finished_at, has_stats, last_stats, eta_seconds,
       submitter_uid, submitter, last_eval_step, last_eval_loss, best_eval_step, best_eval_loss);
  }
  // Takes the evaluation of `stats` into last_eval_* and best_eval_* (none: no change).
  void NoteEval(const StepStats& stats) {
    if (!stats.has_eval()) return;
    last_eval_step = stats.step;
    last_eval_loss = stats.eval_loss;
    if (best_eval_step == 0 || stats.eval_loss < best_eval_loss) {
      best_eval_step = stats.step;
      best_eval_loss = stats.eval_loss;
    }
  }
};

struct WorkerSummary {
  std::string id;
  std::string host;
  std::string device;
  std::string gpu_name;
  uint64_t gpu_memory_bytes = 0;
  int32_t pid = 0;
  std::vector<StoreInfo> stores;
  bool alive = true;
  std::vector<int64_t> job_ids;  // the jobs it runs, in the order they were assigned
  int32_t slots = 1;             // how many jobs it trains at once
  double seconds_since_heartbeat = 0;
  template <class A>
  void serialize(A& ar) {
    ar(id, host, device, gpu_name, gpu_memory_bytes, pid, stores, alive, job_ids, slots,
       seconds_since_heartbeat);
  }
};

// The command parses and resolves the job file (relative paths against ITS directory of
// work) and sends the result; the coordinator validates it completely.
struct SubmitRequest {
  JobSpec spec;           // spec.priority: higher runs first; ties in submission order
  std::string spec_toml;  // the text as written, for `show`
  template <class A>
  void serialize(A& ar) {
    ar(spec, spec_toml);
  }
};

struct SubmitReply {
  int64_t job_id = 0;                 // 0 when rejected
  std::vector<std::string> problems;  // every problem the validation found
  template <class A>
  void serialize(A& ar) {
    ar(job_id, problems);
  }
};

struct ListJobsRequest {
  bool include_finished = true;
  template <class A>
  void serialize(A& ar) {
    ar(include_finished);
  }
};
struct ListJobsReply {
  std::vector<JobSummary> jobs;
  template <class A>
  void serialize(A& ar) {
    ar(jobs);
  }
};

struct ShowJobRequest {
  int64_t job_id = 0;
  template <class A>
  void serialize(A& ar) {
    ar(job_id);
  }
};
struct ShowJobReply {
  JobSummary job;
  std::string spec_toml;
  int32_t retries = 0;
  template <class A>
  void serialize(A& ar) {
    ar(job, spec_toml, retries);
  }
};

struct StatsRequest {
  int64_t job_id = 0;
  template <class A>
  void serialize(A& ar) {
    ar(job_id);
  }
};
struct StatsReply {
  int64_t job_id = 0;
  std::vector<StepStats> stats;  // downsampled, in step order
  template <class A>
  void serialize(A& ar) {
    ar(job_id, stats);
  }
};

struct CancelRequest {
  int64_t job_id = 0;
  template <class A>
  void serialize(A& ar) {
    ar(job_id);
  }
};
struct CancelReply {
  JobState state = JobState::kQueued;  // kCancelled, or kRunning while it winds down
  template <class A>
  void serialize(A& ar) {
    SerializeEnum(ar, state, JobState::kCancelled);
  }
};

struct ListWorkersRequest {
  bool include_dead = true;
  template <class A>
  void serialize(A& ar) {
    ar(include_dead);
  }
};
struct ListWorkersReply {
  std::vector<WorkerSummary> workers;
  template <class A>
  void serialize(A& ar) {
    ar(workers);
  }
};

// Long poll: answered as soon as the coordinator's state version exceeds since_version, or
// after wait_ms with the unchanged state.
struct WatchRequest {
  std::vector<int64_t> job_ids;  // empty: all jobs
  uint64_t since_version = 0;
  int32_t wait_ms = 1000;
  template <class A>
  void serialize(A& ar) {
    ar(job_ids, since_version, wait_ms);
  }
};
struct WatchReply {
  uint64_t version = 0;
  std::vector<JobSummary> jobs;
  std::vector<WorkerSummary> workers;
  template <class A>
  void serialize(A& ar) {
    ar(version, jobs, workers);
  }
};

template <class T>
struct MessageTraits;
#define LORASTREAM_MESSAGE(T, TYPE, REPLY)                  \
  template <>                                               \
  struct MessageTraits<T> {                                 \
    static constexpr MessageType kType = MessageType::TYPE; \
    using Reply = REPLY;                                    \
  };
LORASTREAM_MESSAGE(ErrorReply, kError, void)
LORASTREAM_MESSAGE(RegisterRequest, kRegister, RegisterReply)
LORASTREAM_MESSAGE(RegisterReply, kRegisterReply, void)
LORASTREAM_MESSAGE(HeartbeatRequest, kHeartbeat, HeartbeatReply)
LORASTREAM_MESSAGE(HeartbeatReply, kHeartbeatReply, void)
LORASTREAM_MESSAGE(StepReport, kStepReport, WorkerAck)
LORASTREAM_MESSAGE(CheckpointReport, kCheckpointReport, WorkerAck)
LORASTREAM_MESSAGE(JobFinished, kJobFinished, WorkerAck)
LORASTREAM_MESSAGE(WorkerAck, kWorkerAck, void)
LORASTREAM_MESSAGE(SubmitRequest, kSubmit, SubmitReply)
LORASTREAM_MESSAGE(SubmitReply, kSubmitReply, void)
LORASTREAM_MESSAGE(ListJobsRequest, kListJobs, ListJobsReply)
LORASTREAM_MESSAGE(ListJobsReply, kListJobsReply, void)
LORASTREAM_MESSAGE(ShowJobRequest, kShowJob, ShowJobReply)
LORASTREAM_MESSAGE(ShowJobReply, kShowJobReply, void)
LORASTREAM_MESSAGE(StatsRequest, kStats, StatsReply)
LORASTREAM_MESSAGE(StatsReply, kStatsReply, void)
LORASTREAM_MESSAGE(CancelRequest, kCancel, CancelReply)
LORASTREAM_MESSAGE(CancelReply, kCancelReply, void)
LORASTREAM_MESSAGE(ListWorkersRequest, kListWorkers, ListWorkersReply)
LORASTREAM_MESSAGE(ListWorkersReply, kListWorkersReply, void)
LORASTREAM_MESSAGE(WatchRequest, kWatch, WatchReply)
LORASTREAM_MESSAGE(WatchReply, kWatchReply, void)
#undef LORASTREAM_MESSAGE

// Serializes `message` into an envelope of its type.
template <class T>
std::string EncodeMessage(const T& message, uint32_t request_id) {
  std::string payload;
  {
    MessageOutputArchive ar(&payload);
    ar(message);
  }
  return EncodeEnvelope(static_cast<uint16_t>(MessageTraits<T>::kType), request_id, payload);
}

// A message's cereal bytes without an envelope (the journal stores job specs this way).
template <class T>
std::string SerializePayload(const T& value) {
  std::string out;
  MessageOutputArchive ar(&out);
  ar(value);
  return out;
}
template <class T>
T DeserializePayload(std::string_view bytes, const std::string& what) {
  T value;
  MessageInputArchive ar(bytes.data(), bytes.size());
  try {
    ar(value);
  } catch (const cereal::Exception& e) {
    throw Error(ErrorCode::kCorrupt, what + ": " + e.what());
  } catch (const Error& e) {
    throw Error(ErrorCode::kCorrupt, what + ": " + e.what());
  }
  if (ar.remaining() != 0)
    throw Error(ErrorCode::kCorrupt,
                what + ": " + std::to_string(ar.remaining()) + " unexpected trailing bytes");
  return value;
}

// Decodes the payload of an envelope that must hold a T. Wrong type -> kProtocol; a payload
// that is short, has bytes left over or holds out-of-range values -> kCorrupt.
void CheckMessageType(const Envelope& envelope, MessageType expected);
[[noreturn]] void ThrowTrailing(const Envelope& envelope, size_t left);

template <class T>
T DecodeMessage(const Envelope& envelope) {
  CheckMessageType(envelope, MessageTraits<T>::kType);
  T message;
  MessageInputArchive ar(envelope.payload.data(), envelope.payload.size());
  try {
    ar(message);
  } catch (const cereal::Exception& e) {
    throw Error(ErrorCode::kCorrupt,
                std::string("message ") + MessageTypeName(envelope.header.type) + ": " + e.what());
  } catch (const Error& e) {
    throw Error(e.code(),
                std::string("message ") + MessageTypeName(envelope.header.type) + ": " + e.what());
  }
  if (ar.remaining() != 0) ThrowTrailing(envelope, ar.remaining());
  return message;
}

}  // namespace lorastream
