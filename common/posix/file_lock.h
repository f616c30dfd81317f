// An exclusive advisory lock held for the lifetime of an object (RAII, move-only): flock on a
// small file that also records who holds it. The kernel drops the lock when the holder dies,
// so a crashed holder never leaves a stale lock behind; the text it wrote stays only as a
// hint for the next refusal. Used for the coordinator's journal (one coordinator per
// journal) and for a job's output folder (one job per folder while it trains).
#pragma once

#include <sys/types.h>

#include <string>

namespace lorastream {

class FileLock {
 public:
  // Opens (creating with `mode`, never following a symbolic link) `path` and locks it
  // without waiting. On success the file holds `holder` (e.g. "pid 123"). When another open
  // file holds the lock, throws Error(kRefused): "<what> is in use by <the holder's text>
  // (lock file <path>)". Other failures: Error(kIo) naming the path.
  static FileLock Acquire(const std::string& path, const std::string& holder,
                          const std::string& what, mode_t mode = 0600);
  // Opens `path` as Acquire does and locks it when it is free; when another open file holds
  // the lock the result is open but not locked() (its holder text readable), Error(kIo) for
  // other failures. For a lock that a successor may take over (common/job/job_access.h).
  static FileLock Open(const std::string& path, mode_t mode = 0600);

  FileLock() = default;
  FileLock(FileLock&& other) noexcept;
  FileLock& operator=(FileLock&& other) noexcept;
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;
  ~FileLock();  // unlocks; the file stays (removing it would race with the next holder)

  bool held() const { return fd_ >= 0 && locked_; }
  // Takes the lock of an Open()ed file when it is free now; true when held.
  bool TryLock();
  // The first line of what the holder wrote (a placeholder when nothing).
  std::string Holder() const;
  // Replaces the holder text (also while another file holds the lock: a takeover).
  void SetHolder(const std::string& holder);
  int fd() const { return fd_; }
  const std::string& path() const { return path_; }

 private:
  int fd_ = -1;
  bool locked_ = false;
  std::string path_;
};

}  // namespace lorastream
