#include "common/file_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <utility>

#include "common/error.h"

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

FileLock FileLock::Acquire(const std::string& path, const std::string& holder,
                           const std::string& what, mode_t mode) {
  FileLock lock;
  lock.fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, mode);
  if (lock.fd_ < 0) ThrowErrno("cannot open lock file " + path);
  lock.path_ = path;
  if (::flock(lock.fd_, LOCK_EX | LOCK_NB) != 0) {
    if (errno == EWOULDBLOCK)
      throw Error(ErrorCode::kRefused,
                  what + " is in use by " + HolderText(lock.fd_) + " (lock file " + path + ")");
    ThrowErrno("cannot lock " + path);
  }
  const std::string text = holder + "\n";
  if (::ftruncate(lock.fd_, 0) != 0 ||
      ::pwrite(lock.fd_, text.data(), text.size(), 0) != static_cast<ssize_t>(text.size()))
    ThrowErrno("cannot write lock file " + path);
  return lock;
}

FileLock::FileLock(FileLock&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), path_(std::move(other.path_)) {}

FileLock& FileLock::operator=(FileLock&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
    path_ = std::move(other.path_);
  }
  return *this;
}

FileLock::~FileLock() {
  if (fd_ >= 0) ::close(fd_);  // closing the last descriptor releases the flock
}

}  // namespace lorastream
