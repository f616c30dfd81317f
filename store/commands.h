// `lorastream-store ls` and `lorastream-store verify`.
#pragma once

#include <ostream>
#include <string>

namespace lorastream::store {

// Lists every store in /dev/shm: state, owner, segments, bytes, attached processes.
void RunLs(std::ostream& out);

// Attaches read-only and re-checks every checksum; throws Error(kCorrupt) on a mismatch.
void RunVerify(const std::string& name, int threads, std::ostream& out);

}  // namespace lorastream::store
