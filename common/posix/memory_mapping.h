// An owned memory mapping: munmap'ed when its owner dies. Move-only. The fd it was mapped
// from may be closed at once: the mapping keeps the file or shared-memory object alive.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace lorastream {

class MemoryMapping {
 public:
  // mmap(nullptr, size, prot, flags, fd, offset); throws Error (the errno's code) naming
  // `what` when it fails. MAP_ANONYMOUS mappings pass fd -1.
  static MemoryMapping Map(size_t size, int prot, int flags, int fd, off_t offset,
                           const std::string& what);

  MemoryMapping() = default;
  MemoryMapping(void* data, size_t size) noexcept : data_(data), size_(size) {}  // adopts
  MemoryMapping(MemoryMapping&& other) noexcept;
  MemoryMapping& operator=(MemoryMapping&& other) noexcept;
  MemoryMapping(const MemoryMapping&) = delete;
  MemoryMapping& operator=(const MemoryMapping&) = delete;
  ~MemoryMapping() { Reset(); }

  void* data() const { return data_; }
  uint8_t* bytes() const { return static_cast<uint8_t*>(data_); }
  size_t size() const { return size_; }  // the length given to mmap
  bool valid() const { return data_ != nullptr; }
  // Unmaps now (keeping errno); the handle then holds nothing.
  void Reset() noexcept;

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace lorastream
