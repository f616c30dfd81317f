#include "worker/stream/host_bytes.h"

#include <sys/mman.h>
#include <unistd.h>

#include "common/base/error.h"

namespace lorastream::worker {

HostBytes HostBytes::Allocate(uint64_t size, const std::string& what) {
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t pages = size == 0 ? 1 : (size + page - 1) / page;
  HostBytes b;
  b.map_ = MemoryMapping::Map(pages * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1,
                              0, what + ": mapping " + std::to_string(pages * page) + " bytes");
  b.size_ = size;
  return b;
}

void HostBytes::MakeReadOnly() {
  if (map_.valid() && mprotect(map_.data(), map_.size(), PROT_READ) != 0)
    ThrowErrno("mprotect of " + std::to_string(map_.size()) + " host bytes");
}

}  // namespace lorastream::worker
