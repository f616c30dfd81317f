// What a worker does before it runs a job for another user (README: Trust model): it opens
// no path of the job that the job's submitter could not open. A root worker then opens and
// creates the job's files as the submitter (common/posix/acting_as.h), so that the kernel checks
// each open where it is made; this check comes first, to refuse with a message that names
// the job file's key. Torch-free.
#pragma once

#include <cstdint>
#include <string>

#include "common/job/job_spec.h"
#include "common/posix/file_lock.h"
#include "common/posix/user_access.h"

namespace lorastream {

// Throws Error(kRefused) naming the key, the path, the user and the component at fault when
// `who` may not read data.path, eval.path, model.checkpoint or any file in it (and what its
// links resolve to), or may not write or create train.output_dir or train.stats_file
// (AccessProblem along every path component).
void CheckJobPathsAs(const JobSpec& spec, const UserIdentity& who);

// A job's output folder is trained into by one job at a time: an exclusive lock on
// OUTPUT_DIR/.lorastream.lock, held while the job trains, whose text names the holder ("job 7
// attempt 1 (lorastream-worker pid 88)").
constexpr const char* kOutputDirLockName = ".lorastream.lock";

// "job J attempt A (...)": the holder text of a job attempt that a coordinator assigned.
std::string AttemptHolder(int64_t job_id, int32_t attempt, const std::string& who);

class OutputDirLock {
 public:
  // Locks OUTPUT_DIR/.lorastream.lock for `holder`. When another process holds it:
  //  - if its text names an earlier attempt of the job `holder` names (AttemptHolder), the
  //    coordinator declared that attempt dead and gave the job to this one, which takes the
  //    folder over: its text replaces the older one's (the fence: the older attempt, if it
  //    still runs, stops at its next step) and it takes the lock itself once the older one
  //    lets go;
  //  - otherwise Error(kRefused): "train.output_dir DIR is in use by <holder> (lock file ...)".
  static OutputDirLock Acquire(const std::string& output_dir, const std::string& holder);
  // Creates `output_dir` when missing (Error(kIo) naming it when it cannot be), then
  // Acquire with `holder`, "" meaning "lorastream-worker pid N". A trainer holds it from
  // before it looks for a checkpoint to resume until it returns: one job trains into a folder
  // at a time.
  static OutputDirLock CreateAndAcquire(const std::string& output_dir, const std::string& holder);

  // Whether this holder still owns the folder: false once a later attempt took it over.
  // Cheap (one small read); call it before every write of a step.
  bool StillOwned();
  // Error(kRefused) naming the attempt that took the folder over, when !StillOwned().
  void RequireOwned();
  bool locked() const { return lock_.held(); }

 private:
  OutputDirLock(FileLock lock, std::string holder, std::string dir)
      : lock_(std::move(lock)), holder_(std::move(holder)), dir_(std::move(dir)) {}
  FileLock lock_;
  std::string holder_;
  std::string dir_;
};

}  // namespace lorastream
