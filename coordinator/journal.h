// The coordinator's journal: jobs, their states, checkpoints and downsampled statistics in
// SQLite (WAL mode), so that a restarted coordinator loses nothing. Every state change is
// written before the reply that announces it leaves the coordinator.
#pragma once

#include <string>
#include <vector>

#include "common/file_lock.h"
#include "common/step_stats.h"
#include "coordinator/job_record.h"

struct sqlite3;

namespace lorastream::coordinator {

class Journal {
 public:
  // Opens (creating when missing) the database at `path`; ":memory:" for tests.
  // Throws Error(kIo) when it cannot be opened, kCorrupt when it is not a journal, kRefused
  // (naming the holder's pid) when another process holds it. A journal belongs to one
  // process for that process's lifetime: an exclusive lock on PATH.lock, which records the
  // holder's pid. The journal and its files are owner-only (0600): job specs name the
  // users' files.
  explicit Journal(const std::string& path);
  ~Journal();
  Journal(const Journal&) = delete;
  Journal& operator=(const Journal&) = delete;
  Journal(Journal&& other) noexcept;
  Journal& operator=(Journal&& other) noexcept;

  // Inserts or replaces the job's row (keyed by summary.id).
  void SaveJob(const JobRecord& job);
  std::vector<JobRecord> LoadJobs() const;  // in id order

  void AppendStats(int64_t job_id, int32_t attempt, const StepStats& stats);
  std::vector<StepStats> LoadStats(int64_t job_id) const;  // in step order, one row per step

 private:
  void Exec(const char* sql) const;
  FileLock lock_;  // declared first: released after the database is closed
  sqlite3* db_ = nullptr;
  std::string path_;
};

}  // namespace lorastream::coordinator
