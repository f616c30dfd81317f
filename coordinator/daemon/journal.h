// The coordinator's journal: jobs, their states, checkpoints and downsampled statistics in
// SQLite (WAL mode), so that a restarted coordinator loses nothing. Every state change is
// written before the reply that announces it leaves the coordinator. The file carries a
// version (journal.cc says what each one changed): a build upgrades an older journal when it
// opens it, keeping every job, and refuses a newer one. tests/fixtures/journal-* hold journals
// of earlier versions that every build must open with every job as it was.
#pragma once

#include <string>
#include <vector>

#include "common/job/step_stats.h"
#include "common/posix/file_lock.h"
#include "coordinator/daemon/job_record.h"

struct sqlite3;

namespace lorastream::coordinator {

class Journal {
 public:
  // Opens (creating when missing) the database at `path`; ":memory:" for tests.
  // Throws Error(kIo) when it cannot be opened, kCorrupt when it is not a journal (tables of
  // something else, no jobs table, a version below 0, a jobs table without a column its
  // version has, or a job in an older one that cannot be read), kUnsupported (naming its version)
  // when a newer build wrote it, kRefused (naming the holder's pid) when another process holds it.
  // A journal belongs to one process for that process's lifetime: an exclusive lock on PATH.lock,
  // which records the holder's pid. The journal and its files are owner-only (0600): job specs name
  // the users' files.
  explicit Journal(const std::string& path);
  ~Journal();
  Journal(const Journal&) = delete;
  Journal& operator=(const Journal&) = delete;
  Journal(Journal&& other) noexcept;
  Journal& operator=(Journal&& other) noexcept;

  // Inserts or replaces the job's row (keyed by summary.id).
  void SaveJob(const JobRecord& job);
  // Every job in id order. A row that cannot be read (its spec missing, NULL or not a job
  // file, its state unknown) is skipped, never dispatched: an error naming the journal, the
  // job and why is logged and appended to `skipped`; the row stays as it is.
  std::vector<JobRecord> LoadJobs(std::vector<std::string>* skipped = nullptr) const;
  // The highest job id of any row, skipped ones included (0: none): ids are never reused.
  int64_t MaxJobId() const;

  void AppendStats(int64_t job_id, int32_t attempt, const StepStats& stats);
  std::vector<StepStats> LoadStats(int64_t job_id) const;  // in step order, one row per step

  // Why a job with `spec` could not be kept as it is ("" when it can): the journal writes a
  // spec as a job file (JobSpecToToml), and a spec built elsewhere than from one may hold
  // values a job file cannot. The coordinator refuses such a job at submission.
  static std::string RecordProblem(const JobSpec& spec);

 private:
  class Transaction;
  void Exec(const char* sql) const;
  int64_t Int(const char* sql) const;  // the first column of the first row (0: none)
  bool HasColumn(const char* table, const char* column) const;
  void UpgradeToVersion1();
  FileLock lock_;  // declared first: released after the database is closed
  sqlite3* db_ = nullptr;
  std::string path_;
};

}  // namespace lorastream::coordinator
