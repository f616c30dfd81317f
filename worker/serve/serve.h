// `lorastream-worker serve`: the worker taking jobs from the coordinator. The protocol lives
// in the torch-free WorkerAgent (coordinator/client/worker_agent.h); this file plugs the job group
// (GroupTrainer) in as the runner of its job slots and describes this worker (device, GPU,
// stores, slots).
#pragma once

#include <atomic>
#include <string>
#include <vector>

namespace lorastream::worker {  // the store has a `serve` of its own (lorastream::store)

struct ServeOptions {
  std::string coordinator;          // endpoint (default: the coordinator's ipc default)
  std::string curve_keys;           // folder from `lorastream keygen` ("" = no CURVE)
  std::string device = "cpu";       // "cpu" | "cuda:N"
  std::vector<std::string> stores;  // NAME or AS=NAME (StoreOffer); empty = every live store
  double store_wait_s = 30;         // how long a named store may still be loading
  int threads = 0;                  // CPU threads for training (0 = every core)
  // Job slots: jobs trained at once as one job group (0: DefaultJobSlots of the device,
  // common/job/job_group.h).
  int jobs = 0;
  bool stream = true;            // stream blocks through the engine (false: resident)
  double request_timeout_s = 5;  // per coordinator request
  // While *hold_at_checkpoint is true (SIGUSR1 in the executable; SIGUSR2 clears it), a job
  // that reports a checkpoint holds right after the report, heartbeats going on, until the
  // flag clears, the job must stop, or the process is killed: a point at which a test or an
  // operator knows the job is mid-run with a checkpoint to resume from. nullptr: never.
  const std::atomic<bool>* hold_at_checkpoint = nullptr;
};

// Serves until `stop` (SIGINT/SIGTERM in the executable); a job running then is stopped at
// its next step boundary (checkpoint saved) and requeued by the coordinator. Returns the
// exit status. Throws Error for a bad device or a store that cannot be attached.
int RunServe(const ServeOptions& options, const std::atomic<bool>& stop);

}  // namespace lorastream::worker
