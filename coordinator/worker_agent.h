// The worker's side of the protocol, torch-free: registration, heartbeats, taking jobs,
// reporting step statistics, checkpoints and the end of each job, and the stop flag that
// cancellation raises. What a job does is the JobRunner's business (the real one, in
// worker/serve/serve.cc, calls the trainer; tests plug in a simple runner).
//
// Threads: Run() owns the calling thread, which registers, polls for work while idle and
// calls the runner. While a job runs, a second thread sends heartbeats and the queued
// reports, so a slow or restarting coordinator never stalls training. Reports wait in a
// bounded queue while the coordinator is unreachable. After a coordinator restart the agent
// registers again, naming the job it runs, and keeps running it only if the coordinator
// agrees.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/messages.h"
#include "coordinator/client.h"

namespace lorastream::client {

struct WorkerAgentOptions {
  ClientOptions client;        // endpoint, CURVE keys, per-request timeout
  std::string host;            // "": gethostname()
  std::string device = "cpu";  // "cuda:N" | "cpu"
  std::string gpu_name;        // "" on CPU
  uint64_t gpu_memory_bytes = 0;
  std::vector<StoreInfo> stores;       // stores this host can attach (name + fingerprint)
  double retry_interval_s = 0.5;       // between attempts while the coordinator is unreachable
  size_t max_queued_reports = 100000;  // oldest step reports are dropped beyond this
};

// What a runner gets. report_* only queue (never block, never throw); should_stop turns true
// when the job was cancelled, went to another worker, or the agent is shutting down — the
// runner then saves the adapter at the step boundary and returns kStopped.
struct JobContext {
  const JobAssignment& assignment;
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

// May throw: an Error becomes the job's failure with its message.
using JobRunner = std::function<JobResult(const JobContext&)>;

class WorkerAgent {
 public:
  WorkerAgent(WorkerAgentOptions options, JobRunner runner);
  ~WorkerAgent();
  WorkerAgent(const WorkerAgent&) = delete;
  WorkerAgent& operator=(const WorkerAgent&) = delete;

  // Serves jobs until `stop` becomes true; a job running then is stopped at its next step
  // boundary and reported as interrupted (the coordinator requeues it). Returns the number
  // of jobs run.
  int Run(const std::atomic<bool>& stop);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace lorastream::client
