#include "common/posix/file_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <utility>

#include "common/base/error.h"

namespace lorastream {
namespace {

// The first line of what the holder wrote (bounded: the file may hold anything).
std::string HolderText(int fd) {
  char buf[256] = {};
  ssize_t n = ::pread(fd, buf, sizeof(buf) - 1, 0);
  std::string text(buf, n > 0 ? static_cast<size_t>(n) : 0);
  text = text.substr(0, text.find('\n'));
  return text.empty() ? "another process (it wrote nothing)" : text;
}

}  // namespace

FileLock FileLock::Open(const std::string& path, mode_t mode) {
  FileLock lock;
  lock.fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, mode);
  if (lock.fd_ < 0) ThrowErrno("cannot open lock file " + path);
  lock.path_ = path;
  lock.TryLock();
  return lock;
}

bool FileLock::TryLock() {
  if (locked_) return true;
  if (::flock(fd_, LOCK_EX | LOCK_NB) == 0) return locked_ = true;
  if (errno != EWOULDBLOCK) ThrowErrno("cannot lock " + path_);
  return false;
}

std::string FileLock::Holder() const { return HolderText(fd_); }

void FileLock::SetHolder(const std::string& holder) {
  const std::string text = holder + "\n";
  if (::ftruncate(fd_, 0) != 0 ||
      ::pwrite(fd_, text.data(), text.size(), 0) != static_cast<ssize_t>(text.size()))
    ThrowErrno("cannot write lock file " + path_);
}

FileLock FileLock::Acquire(const std::string& path, const std::string& holder,
                           const std::string& what, mode_t mode) {
  FileLock lock = Open(path, mode);
  if (!lock.locked_)
    throw Error(ErrorCode::kRefused,
                what + " is in use by " + lock.Holder() + " (lock file " + path + ")");
  lock.SetHolder(holder);
  return lock;
}

FileLock::FileLock(FileLock&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)),
      locked_(std::exchange(other.locked_, false)),
      path_(std::move(other.path_)) {}

FileLock& FileLock::operator=(FileLock&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
    locked_ = std::exchange(other.locked_, false);
    path_ = std::move(other.path_);
  }
  return *this;
}

FileLock::~FileLock() {
  if (fd_ >= 0) ::close(fd_);  // closing the last descriptor releases the flock
}

}  // namespace lorastream
