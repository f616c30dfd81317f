#include "common/posix/durable_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>

#include "common/base/error.h"
#include "common/posix/unique_fd.h"

namespace lorastream {

namespace fs = std::filesystem;

void FsyncPath(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) ThrowErrno("cannot open " + path + " to sync it");
  if (::fsync(fd.get()) != 0) ThrowErrno("cannot sync " + path);
}

void FsyncFolder(const std::string& dir) {
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec))
    if (entry.is_regular_file(ec)) FsyncPath(entry.path().string());
  if (ec) throw Error(ErrorCode::kIo, "cannot list " + dir + ": " + ec.message());
  FsyncPath(dir);
}

void WriteAll(int fd, const void* data, size_t n, const std::string& path) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t wrote = ::write(fd, p, n);
    if (wrote < 0 && errno == EINTR) continue;
    if (wrote <= 0) ThrowErrno("cannot write " + path);
    p += wrote;
    n -= static_cast<size_t>(wrote);
  }
}

void WriteFileDurably(const std::string& path, const std::string& contents) {
  const std::string tmp = path + ".tmp";
  {
    UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (!fd.valid()) ThrowErrno("cannot create " + tmp);
    WriteAll(fd.get(), contents.data(), contents.size(), tmp);
    if (::fsync(fd.get()) != 0) ThrowErrno("cannot sync " + tmp);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) ThrowErrno("cannot rename " + tmp + " to " + path);
  fs::path parent = fs::path(path).parent_path();
  FsyncPath(parent.empty() ? std::string(".") : parent.string());
}

}  // namespace lorastream
