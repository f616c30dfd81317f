// `lorastream-store ls` and `lorastream-store verify`.
#pragma once

#include <ostream>
#include <string>

namespace lorastream::store {

// Lists every store in /dev/shm: state, owner, segments, bytes, attached processes.
void RunLs(std::ostream& out);

// Attaches read-only and re-checks every checksum; throws Error(kCorrupt) on a mismatch.
// `hold`: then stays attached, every page read, until SIGTERM or SIGINT (a reader for
// measuring the memory of a store and many attached processes).
void RunVerify(const std::string& name, int threads, std::ostream& out, bool hold = false);

}  // namespace lorastream::store
