#include "common/posix/unique_fd.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>

#include "common/base/error.h"

namespace lorastream {

void UniqueFd::Reset(int fd) noexcept {
  if (fd_ >= 0 && fd_ != fd) {
    const int saved = errno;
    ::close(fd_);  // the descriptor is released even when close reports an error (Linux)
    errno = saved;
  }
  fd_ = fd;
}

UniquePipe MakePipe(int flags, const char* what) {
  int ends[2];
  if (::pipe2(ends, flags) != 0) ThrowErrno(what);
  return UniquePipe{UniqueFd(ends[0]), UniqueFd(ends[1])};
}

}  // namespace lorastream
