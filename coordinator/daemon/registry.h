// The workers the coordinator knows: what each registered with, when it was last heard of and
// which jobs (attempts) it runs in its job slots. A worker that misses heartbeats for longer than
// the timeout is declared dead (kept for `workers` listings, but it must register again to get
// work).
#pragma once

#include <map>
#include <string>
#include <vector>

#include "common/protocol/messages.h"

namespace lorastream::coordinator {

struct WorkerEntry {
  std::string id;
  RegisterRequest info;
  double last_seen = 0;  // steady seconds
  bool alive = true;
  std::vector<RunningJob> jobs;  // in the order they were assigned; at most slots()

  int32_t slots() const { return info.slots > 0 ? info.slots : 1; }
  int32_t free_slots() const { return slots() - static_cast<int32_t>(jobs.size()); }
  // The attempt of `job_id` this worker runs (0: it runs no attempt of it).
  int32_t AttemptOf(int64_t job_id) const;
  void Drop(int64_t job_id);
  bool HasStore(const std::string& name, const std::string& fingerprint) const;
  std::string FingerprintOf(const std::string& store) const;  // "" when absent
  WorkerSummary Summary(double now) const;
};

class WorkerRegistry {
 public:
  // Adds (or replaces, for a re-registration under the same id) a live worker.
  WorkerEntry& Add(const std::string& id, const RegisterRequest& info, double now);
  WorkerEntry* FindAlive(const std::string& id);
  std::vector<const WorkerEntry*> Alive() const;  // in id order
  const WorkerEntry* Find(const std::string& id) const;
  // Live workers silent for longer than timeout_s; the caller marks them dead.
  std::vector<WorkerEntry*> Expired(double now, double timeout_s);
  std::vector<WorkerSummary> Summaries(double now, bool include_dead) const;
  // Forgets dead workers beyond the newest `keep` (a long-running coordinator would grow).
  void Prune(size_t keep);

 private:
  std::map<std::string, WorkerEntry> workers_;
};

// A fresh unguessable worker id: the token a worker proves its identity with.
std::string NewWorkerId();

}  // namespace lorastream::coordinator
