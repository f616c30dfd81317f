// Opening a file named by a user (a job file, a cache, a data file, a checkpoint) only when it
// is a regular file, and reading it with a bound. The open is non-blocking, so a FIFO, a
// terminal or a device named where a file is expected is refused at once instead of blocking
// the reader (a FIFO) or feeding it forever (/dev/zero); fstat on the open descriptor decides,
// so a link swapped after a check changes nothing. Every refusal names the file and what it is.
#pragma once

#include <cstdint>
#include <string>

#include "common/posix/unique_fd.h"

namespace lorastream {

// The most a text file lorastream reads whole may hold (config.json, tokenizer.json, index
// files): far above any real one, far below what would exhaust a host.
inline constexpr uint64_t kMaxTextFileBytes = uint64_t{256} << 20;

// The descriptor of `path` opened read-only (blocking mode restored), after fstat said it is a
// regular file. Throws Error: kNotFound when missing, kCorrupt naming the file and its kind
// ("PATH: not a regular file (it is a FIFO)"), kIo for another failure. `what`
// ("job file", "cache file") leads the message when not empty.
UniqueFd OpenRegularFile(const std::string& path, const std::string& what = "");

// Its bytes, refused (kCorrupt, naming the file, its size and the limit) when it holds more
// than `max_bytes`; the size is checked before anything is allocated, and the read stops at
// the size fstat gave.
std::string ReadRegularFile(const std::string& path, uint64_t max_bytes,
                            const std::string& what = "");

// A path that opens the file `fd` holds again, whatever its own path names by then
// ("/proc/self/fd/N", Linux): for readers that stream through std::ifstream, which must read
// the file OpenRegularFile checked, not one swapped in after. `path` itself where /proc is
// not mounted.
std::string DescriptorPath(const UniqueFd& fd, const std::string& path);

// "" when `path` (links followed) is a regular file, else why not, for a message that names
// the key before it: "does not exist", "is not a regular file (it is a FIFO)". Opens nothing.
std::string RegularFileProblem(const std::string& path);

// What `mode` is, in words ("a directory", "a FIFO", "a character device", ...).
const char* FileKindName(unsigned mode);

}  // namespace lorastream
