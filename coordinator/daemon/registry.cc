#include "coordinator/daemon/registry.h"

#include <algorithm>
#include <random>

namespace lorastream::coordinator {

bool WorkerEntry::HasStore(const std::string& name, const std::string& fingerprint) const {
  for (const StoreInfo& s : info.stores)
    if (s.name == name && (fingerprint.empty() || s.fingerprint == fingerprint)) return true;
  return false;
}

int32_t WorkerEntry::AttemptOf(int64_t job_id) const {
  for (const RunningJob& j : jobs)
    if (j.job_id == job_id) return j.attempt;
  return 0;
}

void WorkerEntry::Drop(int64_t job_id) {
  jobs.erase(std::remove_if(jobs.begin(), jobs.end(),
                            [&](const RunningJob& j) { return j.job_id == job_id; }),
             jobs.end());
}

std::string WorkerEntry::FingerprintOf(const std::string& store) const {
  for (const StoreInfo& s : info.stores)
    if (s.name == store) return s.fingerprint;
  return "";
}

WorkerSummary WorkerEntry::Summary(double now) const {
  WorkerSummary s;
  s.id = id;
  s.host = info.host;
  s.device = info.device;
  s.gpu_name = info.gpu_name;
  s.gpu_memory_bytes = info.gpu_memory_bytes;
  s.pid = info.pid;
  s.stores = info.stores;
  s.alive = alive;
  for (const RunningJob& j : jobs) s.job_ids.push_back(j.job_id);
  s.slots = slots();
  s.seconds_since_heartbeat = now - last_seen;
  return s;
}

WorkerEntry& WorkerRegistry::Add(const std::string& id, const RegisterRequest& info, double now) {
  WorkerEntry& w = workers_[id];
  w.id = id;
  w.info = info;
  w.last_seen = now;
  w.alive = true;
  w.jobs.clear();
  return w;
}

WorkerEntry* WorkerRegistry::FindAlive(const std::string& id) {
  auto it = workers_.find(id);
  return it != workers_.end() && it->second.alive ? &it->second : nullptr;
}

std::vector<const WorkerEntry*> WorkerRegistry::Alive() const {
  std::vector<const WorkerEntry*> out;
  for (const auto& [id, w] : workers_)
    if (w.alive) out.push_back(&w);
  return out;
}

const WorkerEntry* WorkerRegistry::Find(const std::string& id) const {
  auto it = workers_.find(id);
  return it != workers_.end() ? &it->second : nullptr;
}

std::vector<WorkerEntry*> WorkerRegistry::Expired(double now, double timeout_s) {
  std::vector<WorkerEntry*> out;
  for (auto& [id, w] : workers_)
    if (w.alive && now - w.last_seen > timeout_s) out.push_back(&w);
  return out;
}

std::vector<WorkerSummary> WorkerRegistry::Summaries(double now, bool include_dead) const {
  std::vector<WorkerSummary> out;
  for (const auto& [id, w] : workers_)
    if (w.alive || include_dead) out.push_back(w.Summary(now));
  return out;
}

void WorkerRegistry::Prune(size_t keep) {
  std::vector<std::pair<double, std::string>> dead;
  for (const auto& [id, w] : workers_)
    if (!w.alive) dead.emplace_back(w.last_seen, id);
  if (dead.size() <= keep) return;
  std::sort(dead.begin(), dead.end());
  for (size_t i = 0; i + keep < dead.size(); ++i) workers_.erase(dead[i].second);
}

std::string NewWorkerId() {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  char buf[40];
  std::snprintf(buf, sizeof(buf), "w-%016llx%08llx", static_cast<unsigned long long>(rng()),
                static_cast<unsigned long long>(rng() & 0xffffffffu));
  return buf;
}

}  // namespace lorastream::coordinator
