// Durability on a POSIX file system: data is safe only after fsync of the file AND of the
// folder that names it; a rename publishes atomically only once both sides are synced.
#pragma once

#include <string>

namespace lorastream {

// fsync of a file or a folder; throws Error(kIo) naming the path.
void FsyncPath(const std::string& path);

// fsync of every regular file directly inside `dir`, then of `dir` itself.
void FsyncFolder(const std::string& dir);

// Writes `contents` to `path` so that a crash leaves either the old file or the new one:
// a temporary beside it, written and fsynced, renamed over `path`, then the folder fsynced.
// Every failed write (a full disk, /dev/full) throws Error(kIo) naming the path.
void WriteFileDurably(const std::string& path, const std::string& contents);

// Writes all of `n` bytes to `fd` (retrying short writes and EINTR); throws Error(kIo)
// naming `path` on failure.
void WriteAll(int fd, const void* data, size_t n, const std::string& path);

}  // namespace lorastream
