// SafetensorsFile: a read-only mapping of one .safetensors file whose header was validated
// (ParseSafetensorsHeader) before any tensor pointer is handed out.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "common/error.h"
#include "common/safetensors.h"

namespace lorastream {

SafetensorsFile SafetensorsFile::Open(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) throw Error(ErrorCode::kNotFound, path + ": no such file");
    ThrowErrno(path + ": cannot open");
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int saved = errno;
    ::close(fd);
    errno = saved;
    ThrowErrno(path + ": cannot stat");
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw Error(ErrorCode::kCorrupt, path + ": not a regular file");
  }
  const size_t size = static_cast<size_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    throw Error(ErrorCode::kCorrupt, path + ": file is " + std::to_string(size) +
                                         " bytes, too short for the 8-byte header length");
  }
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  int saved = errno;
  ::close(fd);  // the mapping keeps the file alive
  if (map == MAP_FAILED) {
    errno = saved;
    ThrowErrno(path + ": cannot mmap");
  }
  SafetensorsFile file;
  file.path_ = path;
  file.map_ = static_cast<const uint8_t*>(map);
  file.map_size_ = size;
  // On a throw, `file`'s destructor unmaps.
  file.header_ = ParseSafetensorsHeader(file.map_, size, path);
  return file;
}

SafetensorsFile::SafetensorsFile(SafetensorsFile&& other) noexcept
    : path_(std::move(other.path_)),
      header_(std::move(other.header_)),
      map_(std::exchange(other.map_, nullptr)),
      map_size_(std::exchange(other.map_size_, 0)) {}

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& other) noexcept {
  if (this != &other) {
    if (map_) ::munmap(const_cast<uint8_t*>(map_), map_size_);
    path_ = std::move(other.path_);
    header_ = std::move(other.header_);
    map_ = std::exchange(other.map_, nullptr);
    map_size_ = std::exchange(other.map_size_, 0);
  }
  return *this;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_) ::munmap(const_cast<uint8_t*>(map_), map_size_);
}

const SafetensorsEntry* SafetensorsFile::Find(const std::string& name) const {
  for (const SafetensorsEntry& e : header_.tensors)
    if (e.name == name) return &e;
  return nullptr;
}

const uint8_t* SafetensorsFile::Data(const SafetensorsEntry& entry) const {
  LS_CHECK(header_.data_offset + entry.end <= map_size_, "tensor " + entry.name);
  return map_ + header_.data_offset + entry.begin;
}

}  // namespace lorastream
