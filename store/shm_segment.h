// One POSIX shared-memory object and its mapping (RAII, move-only).
//
// Created segments are owned: the destructor unlinks the name as well as unmapping, so a
// store that fails half-way leaves nothing behind; attached segments are only unmapped.
// The store creates, fills, then MakeReadOnly()s; attachers map PROT_READ from the start,
// so a stray write through an attached pointer faults instead of changing the base.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "common/posix/memory_mapping.h"

namespace lorastream::store {

class ShmSegment {
 public:
  // Creates `name` exclusively with permissions `mode`, reserves `nbytes` of /dev/shm
  // (Error(kResource) naming the size when it does not fit) and maps it read-write; asks for
  // transparent huge pages when `huge_pages` (before any page is touched, as THP requires),
  // then prefaults every page.
  static ShmSegment Create(const std::string& name, size_t nbytes, mode_t mode,
                           bool huge_pages = true);
  // Maps an existing object read-only. Error(kNotFound) when it does not exist, kCorrupt when
  // it is smaller than `min_bytes`, kRefused (naming its owner) when `required_owner` >= 0
  // and the object belongs to another user: checked on the open descriptor, before mapping.
  // `populate` prefaults the page tables.
  static ShmSegment OpenReadOnly(const std::string& name, size_t min_bytes, bool populate = false,
                                 int64_t required_owner = -1);
  static void Unlink(const std::string& name);  // ignores a name that does not exist

  ShmSegment() = default;
  ShmSegment(ShmSegment&& other) noexcept;
  ShmSegment& operator=(ShmSegment&& other) noexcept;
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;
  ~ShmSegment();

  const std::string& name() const { return name_; }
  size_t size() const { return size_; }  // the requested bytes (mapping rounds up to a page)
  size_t mapped_size() const { return mapping_.size(); }  // page-rounded length of the mapping
  const uint8_t* data() const { return mapping_.bytes(); }
  uint8_t* mutable_data();  // only on a created segment before MakeReadOnly()

  // Whether Create()'s huge-page request was accepted by madvise (the kernel may still
  // back the mapping with small pages when shmem THP is "never").
  bool huge_pages_advised() const { return huge_advised_; }
  // mlock; false (errno set) when the memlock limit refuses.
  bool Lock();
  void MakeReadOnly();
  // Keeps the object alive after this handle dies (the name is not unlinked).
  void Disown() { owner_ = false; }

 private:
  void Reset() noexcept;
  std::string name_;
  MemoryMapping mapping_;
  size_t size_ = 0;
  bool owner_ = false;
  bool writable_ = false;
  bool huge_advised_ = false;
};

// Page size rounding used by every mapping.
size_t RoundUpToPage(size_t n);

}  // namespace lorastream::store
