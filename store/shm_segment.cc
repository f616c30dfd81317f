#include "store/shm_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <utility>

#include "common/base/error.h"
#include "common/base/format_bytes.h"
#include "common/posix/unique_fd.h"
#include "common/posix/user_access.h"

namespace lorastream::store {

size_t RoundUpToPage(size_t n) {
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  return n == 0 ? page : (n + page - 1) / page * page;
}

ShmSegment ShmSegment::Create(const std::string& name, size_t nbytes, mode_t mode,
                              bool huge_pages) {
  UniqueFd fd(::shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, mode));
  if (fd.get() < 0) {
    if (errno == EEXIST)
      throw Error(ErrorCode::kRefused, "shared-memory object " + name + " already exists");
    ThrowErrno("shm_open(" + name + ")");
  }
  ShmSegment s;
  s.name_ = name;
  s.owner_ = true;  // from here on, failures unlink the name
  s.size_ = nbytes;
  const size_t mapped = RoundUpToPage(nbytes);
  ::fchmod(fd.get(), mode);  // shm_open's mode is filtered by the umask; the store means it
  if (::ftruncate(fd.get(), static_cast<off_t>(mapped)) != 0) ThrowErrno("ftruncate(" + name + ")");
  // Reserve the memory now: a tmpfs that is too small fails here with ENOSPC instead of a
  // SIGBUS on first touch.
  if (::fallocate(fd.get(), 0, 0, static_cast<off_t>(mapped)) != 0 && errno != EOPNOTSUPP) {
    if (errno == ENOSPC)
      throw Error(ErrorCode::kResource, std::string("/dev/shm") + " is full: " + name + " needs " +
                                            FormatGiB(mapped) +
                                            "; free space or remount it larger "
                                            "(mount -o remount,size=NG /dev/shm)");
    ThrowErrno("fallocate(" + name + ")");
  }
  s.mapping_ = MemoryMapping::Map(mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0,
                                  "mmap(" + name + ")");
  s.writable_ = true;
#ifdef MADV_HUGEPAGE
  if (huge_pages) s.huge_advised_ = ::madvise(s.mapping_.data(), mapped, MADV_HUGEPAGE) == 0;
#endif
    // Prefault: the loader then writes without taking a page fault per 4 KiB.
#ifdef MADV_POPULATE_WRITE
  if (::madvise(s.mapping_.data(), mapped, MADV_POPULATE_WRITE) == 0) return s;
#endif
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  for (size_t off = 0; off < mapped; off += page)
    reinterpret_cast<volatile uint8_t*>(s.mapping_.bytes())[off] = 0;
  return s;
}

ShmSegment ShmSegment::OpenReadOnly(const std::string& name, size_t min_bytes, bool populate,
                                    int64_t required_owner) {
  UniqueFd fd(::shm_open(name.c_str(), O_RDONLY | O_CLOEXEC, 0));
  if (fd.get() < 0) {
    if (errno == ENOENT)
      throw Error(ErrorCode::kNotFound, "shared-memory object " + name + " does not exist");
    ThrowErrno("shm_open(" + name + ")");
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) ThrowErrno("fstat(" + name + ")");
  if (required_owner >= 0 && static_cast<int64_t>(st.st_uid) != required_owner)
    throw Error(ErrorCode::kRefused, "shared-memory object " + name + " belongs to " +
                                         DescribeUser(st.st_uid) +
                                         ", not to the expected store user " +
                                         DescribeUser(static_cast<uid_t>(required_owner)));
  if (static_cast<size_t>(st.st_size) < min_bytes)
    throw Error(ErrorCode::kCorrupt, "shared-memory object " + name + " holds " +
                                         std::to_string(st.st_size) + " bytes, expected " +
                                         std::to_string(min_bytes));
  ShmSegment s;
  s.name_ = name;
  s.size_ = min_bytes;
  s.mapping_ = MemoryMapping::Map(RoundUpToPage(min_bytes), PROT_READ,
                                  MAP_SHARED | (populate ? MAP_POPULATE : 0), fd.get(), 0,
                                  "mmap(" + name + ")");
  return s;
}

void ShmSegment::Unlink(const std::string& name) { ::shm_unlink(name.c_str()); }

ShmSegment::ShmSegment(ShmSegment&& o) noexcept
    : name_(std::move(o.name_)),
      mapping_(std::move(o.mapping_)),
      size_(std::exchange(o.size_, 0)),
      owner_(std::exchange(o.owner_, false)),
      writable_(std::exchange(o.writable_, false)),
      huge_advised_(std::exchange(o.huge_advised_, false)) {}

ShmSegment& ShmSegment::operator=(ShmSegment&& o) noexcept {
  if (this != &o) {
    Reset();
    name_ = std::move(o.name_);
    mapping_ = std::move(o.mapping_);
    size_ = std::exchange(o.size_, 0);
    owner_ = std::exchange(o.owner_, false);
    writable_ = std::exchange(o.writable_, false);
    huge_advised_ = std::exchange(o.huge_advised_, false);
  }
  return *this;
}

ShmSegment::~ShmSegment() { Reset(); }

void ShmSegment::Reset() noexcept {
  mapping_.Reset();
  if (owner_) ::shm_unlink(name_.c_str());
  owner_ = false;
}

uint8_t* ShmSegment::mutable_data() {
  LS_CHECK(writable_, "segment " + name_ + " is read-only");
  return mapping_.bytes();
}

bool ShmSegment::Lock() { return ::mlock(mapping_.data(), mapping_.size()) == 0; }

void ShmSegment::MakeReadOnly() {
  if (::mprotect(mapping_.data(), mapping_.size(), PROT_READ) != 0)
    ThrowErrno("mprotect(" + name_ + ")");
  writable_ = false;
}

}  // namespace lorastream::store
