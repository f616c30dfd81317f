#include "store/manifest_object.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstring>
#include <utility>

#include "common/base/error.h"
#include "common/posix/shm_names.h"
#include "common/posix/unique_fd.h"
#include "common/posix/user_access.h"
#include "store/process.h"

namespace lorastream::store {

namespace {

constexpr char kMagic[8] = {'L', 'S', 'M', 'A', 'N', 'I', 'F', '1'};

struct Header {
  char magic[8];
  uint32_t state;
  uint32_t reserved;
  int64_t owner_pid;
  uint64_t owner_start_time;
  uint64_t json_bytes;
};

void PwriteAll(int fd, const void* data, size_t n, off_t offset, const std::string& name) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::pwrite(fd, p, n, offset);
    if (w < 0) {
      if (errno == EINTR) continue;
      ThrowErrno("write(" + name + ")");
    }
    p += w;
    n -= static_cast<size_t>(w);
    offset += w;
  }
}

bool PreadAll(int fd, void* data, size_t n, off_t offset) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    ssize_t r = ::pread(fd, p, n, offset);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
    offset += r;
  }
  return true;
}

}  // namespace

std::optional<ManifestRecord> ReadManifestObject(const std::string& store_name) {
  const std::string name = ManifestShmName(store_name);
  UniqueFd fd(::shm_open(name.c_str(), O_RDONLY | O_CLOEXEC, 0));
  if (!fd.valid()) {
    if (errno == ENOENT) return std::nullopt;
    ThrowErrno("shm_open(" + name + ")");
  }
  ManifestRecord record;
  Header h{};
  struct stat st {};
  const bool have_stat = ::fstat(fd.get(), &st) == 0;
  record.owner_uid = st.st_uid;
  const bool have_header = have_stat && static_cast<size_t>(st.st_size) >= sizeof(Header) &&
                           PreadAll(fd.get(), &h, sizeof(h), 0);
  if (have_header) {
    if (std::memcmp(h.magic, kMagic, sizeof(kMagic)) != 0)
      throw Error(ErrorCode::kCorrupt, name + ": not a lorastream manifest (bad magic)");
    record.owner_pid = h.owner_pid;
    record.owner_start_time = h.owner_start_time;
    if (h.state == static_cast<uint32_t>(ManifestState::kPublished)) {
      if (h.json_bytes > (256u << 20) ||
          static_cast<uint64_t>(st.st_size) < sizeof(Header) + h.json_bytes)
        throw Error(ErrorCode::kCorrupt, name + ": manifest length runs past the object");
      record.json.resize(h.json_bytes);
      if (!PreadAll(fd.get(), record.json.data(), h.json_bytes, sizeof(Header)))
        throw Error(ErrorCode::kIo, name + ": cannot read the manifest");
      record.state = ManifestState::kPublished;
    }
  }
  return record;
}

ManifestClaim ManifestClaim::Claim(const std::string& store_name, mode_t mode) {
  ManifestClaim claim;
  claim.shm_name_ = ManifestShmName(store_name);
  claim.fd_.Reset(::shm_open(claim.shm_name_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, mode));
  if (!claim.fd_.valid()) {
    if (errno == EEXIST) {
      struct stat st {};
      const std::string path = std::string(kShmDir) + claim.shm_name_;
      std::string by = ::stat(path.c_str(), &st) == 0 ? " by " + DescribeUser(st.st_uid) : "";
      throw Error(ErrorCode::kRefused, "store `" + store_name + "` is being served already" + by +
                                           " (" + claim.shm_name_ +
                                           " exists); choose another --name");
    }
    ThrowErrno("shm_open(" + claim.shm_name_ + ")");
  }
  ::fchmod(claim.fd_.get(), mode);
  Header h{};
  std::memcpy(h.magic, kMagic, sizeof(kMagic));
  h.state = static_cast<uint32_t>(ManifestState::kLoading);
  h.owner_pid = ::getpid();
  h.owner_start_time = ProcessStartTime(::getpid());
  PwriteAll(claim.fd_.get(), &h, sizeof(h), 0, claim.shm_name_);
  return claim;
}

void ManifestClaim::Publish(const Manifest& manifest) {
  const std::string json = ManifestToJson(manifest);
  PwriteAll(fd_.get(), json.data(), json.size(), sizeof(Header), shm_name_);
  const uint64_t n = json.size();
  PwriteAll(fd_.get(), &n, sizeof(n), offsetof(Header, json_bytes), shm_name_);
  // The state flips last: a reader that sees kPublished finds the whole JSON before it.
  const uint32_t state = static_cast<uint32_t>(ManifestState::kPublished);
  PwriteAll(fd_.get(), &state, sizeof(state), offsetof(Header, state), shm_name_);
}

ManifestClaim::ManifestClaim(ManifestClaim&& o) noexcept
    : shm_name_(std::move(o.shm_name_)), fd_(std::move(o.fd_)) {}

ManifestClaim::~ManifestClaim() { Release(); }

void ManifestClaim::Release() noexcept {
  if (!fd_.valid()) return;
  fd_.Reset();
  ::shm_unlink(shm_name_.c_str());
}

}  // namespace lorastream::store
