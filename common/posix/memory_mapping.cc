#include "common/posix/memory_mapping.h"

#include <sys/mman.h>

#include <cerrno>
#include <utility>

#include "common/base/error.h"

namespace lorastream {

MemoryMapping MemoryMapping::Map(size_t size, int prot, int flags, int fd, off_t offset,
                                 const std::string& what) {
  void* p = ::mmap(nullptr, size, prot, flags, fd, offset);
  if (p == MAP_FAILED) ThrowErrno(what);
  return MemoryMapping(p, size);
}

MemoryMapping::MemoryMapping(MemoryMapping&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

MemoryMapping& MemoryMapping::operator=(MemoryMapping&& other) noexcept {
  if (this != &other) {
    Reset();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

void MemoryMapping::Reset() noexcept {
  if (data_ == nullptr) return;
  const int saved = errno;
  ::munmap(data_, size_);
  errno = saved;
  data_ = nullptr;
  size_ = 0;
}

}  // namespace lorastream
