// The worker's side of the protocol, torch-free: registration, heartbeats, taking jobs into the
// worker's job slots, reporting each job's step statistics, checkpoints and end, and the
// per-job stop flag that cancellation raises. What the jobs do is the runner's business (the
// real one, in worker/serve/serve.cc, trains them as one job group; tests plug in a runner
// that imitates training).
//
// Threads: Run() starts the agent's communication thread, then calls the runner on its own
// thread, which is the one training thread. The communication thread registers, sends
// heartbeats, asks for work whenever a slot is free (also while jobs run) and sends the queued
// reports, so a slow or restarting coordinator never stalls training. Reports wait in a
// bounded queue while the coordinator is unreachable. After a coordinator restart the agent
// registers again, naming every job it runs, and keeps running those the coordinator agrees
// to; the others stop without reporting more.
//
// Slots: a job takes its slot when it is assigned and frees it once its end has been reported
// (or refused), so a job that fails frees its slot while the others train on. With one slot
// the agent asks for work only while idle, as a worker of one job at a time.
#pragma once

#include <atomic>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/protocol/messages.h"
#include "coordinator/client/client.h"

namespace lorastream::client {

struct WorkerAgentOptions {
  ClientOptions client;        // endpoint, CURVE keys, per-request timeout
  std::string host;            // "": gethostname()
  std::string device = "cpu";  // "cuda:N" | "cpu"
  std::string gpu_name;        // "" on CPU
  uint64_t gpu_memory_bytes = 0;
  std::vector<StoreInfo> stores;       // stores this host can attach (name + fingerprint)
  int slots = 1;                       // jobs trained at once (one job group)
  double retry_interval_s = 0.5;       // between attempts while the coordinator is unreachable
  size_t max_queued_reports = 100000;  // oldest step reports are dropped beyond this
};

// A job in a slot. report_* only queue (never block, never throw); should_stop turns true when
// the job was cancelled, went to another worker, or the agent is shutting down: the runner
// then saves the job's adapter at its step boundary and ends it as kStopped.
struct JobContext {
  JobAssignment assignment;
  std::function<void(const StepStats&)> report_step;
  std::function<void(int64_t step, const std::string& path)> report_checkpoint;
  std::function<bool()> should_stop;
};

struct JobResult {
  enum class Kind { kCompleted, kStopped, kFailed };
  Kind kind = Kind::kFailed;
  std::string reason;        // for kFailed
  std::string adapter_path;  // where the adapter was saved (completed or stopped)
  int64_t final_step = 0;
};

// What a runner sees of the agent: the jobs assigned to its slots, and where their ends go.
// Called from the training thread only.
class JobSlots {
 public:
  virtual ~JobSlots() = default;
  // The jobs assigned since the last call, in order. With `wait`, blocks until there is one or
  // the agent stops; then it returns none (and jobs assigned meanwhile are handed back).
  virtual std::vector<std::shared_ptr<const JobContext>> Take(bool wait) = 0;
  // The end of a job that Take handed out, exactly once per job: reported, its slot freed.
  virtual void Finish(const JobContext& job, const JobResult& result) = 0;
};

// Trains what `slots` hands it on the calling thread, ending each job through Finish, and
// returns once Take(true) returns none with no job left. An exception it lets out fails every
// job it has not finished, and the agent calls it again.
using SlotRunner = std::function<void(JobSlots& slots)>;

// A job's failure from the exception that ended it, its lines joined into one (what `jobs` and
// `show` can display); LibTorch's backtrace is dropped (WithoutBacktrace) from the reason and
// from this worker's log line alike.
JobResult FailedResult(const std::exception_ptr& error, const JobAssignment& assignment);

class WorkerAgent {
 public:
  WorkerAgent(WorkerAgentOptions options, SlotRunner runner);
  ~WorkerAgent();
  WorkerAgent(const WorkerAgent&) = delete;
  WorkerAgent& operator=(const WorkerAgent&) = delete;

  // Serves jobs until `stop` becomes true; the jobs running then are stopped at their next
  // step boundary and reported as interrupted (the coordinator requeues them). Returns the
  // number of jobs that ended here.
  int Run(const std::atomic<bool>& stop);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace lorastream::client
