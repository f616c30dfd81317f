// Bytes in host RAM that the streaming engine copies from, laid out as a store's segment is:
// starting on a page boundary and owning every page they touch. The CUDA backend registers a
// source's whole pages (cudaHostRegister, read-only), so a buffer that ended inside a page it
// shared with another allocation would register that allocation's start too, and a later
// device-to-host copy into a tensor there would fail. Used wherever the worker packs or
// converts weights for streaming (blocks, a FLUX unit, a converted LM head) and by the
// bandwidth calibration. Torch-free; RAII, move-only: the pages are unmapped with the owner.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "common/posix/memory_mapping.h"

namespace lorastream::worker {

class HostBytes {
 public:
  // `size` zeroed bytes in an anonymous private mapping of whole pages (at least one);
  // throws Error naming `what` when the mapping fails.
  static HostBytes Allocate(uint64_t size, const std::string& what);

  HostBytes() = default;
  HostBytes(HostBytes&& other) noexcept
      : map_(std::move(other.map_)), size_(std::exchange(other.size_, 0)) {}
  HostBytes& operator=(HostBytes&& other) noexcept {
    map_ = std::move(other.map_);
    size_ = std::exchange(other.size_, 0);
    return *this;
  }
  HostBytes(const HostBytes&) = delete;
  HostBytes& operator=(const HostBytes&) = delete;

  uint8_t* data() const { return map_.bytes(); }
  uint64_t size() const { return size_; }               // the bytes asked for
  uint64_t mapped_size() const { return map_.size(); }  // whole pages, >= size()
  // Every page read-only from now on, as a store's segments are to their readers: a write
  // through any view faults instead of changing what is streamed.
  void MakeReadOnly();

 private:
  MemoryMapping map_;
  uint64_t size_ = 0;
};

}  // namespace lorastream::worker
