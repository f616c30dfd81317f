#include "common/posix/regular_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "common/base/error.h"
#include "common/base/format_bytes.h"

namespace lorastream {

namespace {
std::string Named(const std::string& path, const std::string& what) {
  return what.empty() ? path : what + " " + path;
}
}  // namespace

const char* FileKindName(unsigned mode) {
  switch (mode & S_IFMT) {
    case S_IFREG:
      return "a regular file";
    case S_IFDIR:
      return "a directory";
    case S_IFIFO:
      return "a FIFO";
    case S_IFCHR:
      return "a character device";
    case S_IFBLK:
      return "a block device";
    case S_IFSOCK:
      return "a socket";
    case S_IFLNK:
      return "a symbolic link";
    default:
      return "not a regular file";
  }
}

std::string DescriptorPath(const UniqueFd& fd, const std::string& path) {
  const std::string proc = "/proc/self/fd/" + std::to_string(fd.get());
  struct stat st {};
  return ::stat(proc.c_str(), &st) == 0 ? proc : path;
}

std::string RegularFileProblem(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0)
    return errno == ENOENT || errno == ENOTDIR
               ? "does not exist"
               : std::string("cannot be read: ") + std::strerror(errno);
  if (!S_ISREG(st.st_mode))
    return std::string("is not a regular file (it is ") + FileKindName(st.st_mode) + ")";
  return "";
}

UniqueFd OpenRegularFile(const std::string& path, const std::string& what) {
  // O_NONBLOCK: opening a FIFO without a writer would block here; a regular file ignores it.
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY));
  if (!fd.valid()) {
    if (errno == ENOENT)
      throw Error(ErrorCode::kNotFound, Named(path, what) + ": no such file (cannot be opened)");
    ThrowErrno(Named(path, what) + ": cannot open");
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) ThrowErrno(Named(path, what) + ": cannot stat");
  if (!S_ISREG(st.st_mode))
    throw Error(ErrorCode::kCorrupt, Named(path, what) + ": not a regular file (it is " +
                                         FileKindName(st.st_mode) + ")");
  const int flags = ::fcntl(fd.get(), F_GETFL);
  if (flags < 0 || ::fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK) != 0)
    ThrowErrno(Named(path, what) + ": cannot clear O_NONBLOCK");
  return fd;
}

std::string ReadRegularFile(const std::string& path, uint64_t max_bytes, const std::string& what) {
  const UniqueFd fd = OpenRegularFile(path, what);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) ThrowErrno(Named(path, what) + ": cannot stat");
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size > max_bytes)
    throw Error(ErrorCode::kCorrupt, Named(path, what) + " is " + FormatBytes(size) +
                                         ", above the limit of " + FormatBytes(max_bytes) +
                                         " for it");
  std::string out(static_cast<size_t>(size), '\0');
  size_t done = 0;
  while (done < out.size()) {
    const ssize_t n = ::read(fd.get(), out.data() + done, out.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      ThrowErrno(Named(path, what) + ": cannot read");
    }
    if (n == 0) break;  // shrank while read: what is there
    done += static_cast<size_t>(n);
  }
  out.resize(done);
  return out;
}

}  // namespace lorastream
