// SafetensorsFile: a read-only mapping of one .safetensors file whose header was validated
// (ParseSafetensorsHeader) before any tensor pointer is handed out.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include "common/base/error.h"
#include "common/formats/safetensors.h"
#include "common/posix/regular_file.h"
#include "common/posix/unique_fd.h"

namespace lorastream {

SafetensorsFile SafetensorsFile::Open(const std::string& path) {
  // Non-blocking open and fstat first: a FIFO or a device is refused at once, naming it.
  const UniqueFd fd = OpenRegularFile(path);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) ThrowErrno(path + ": cannot stat");
  const size_t size = static_cast<size_t>(st.st_size);
  if (size < 8)
    throw Error(ErrorCode::kCorrupt, path + ": file is " + std::to_string(size) +
                                         " bytes, too short for the 8-byte header length");
  SafetensorsFile file;
  file.path_ = path;
  file.mapping_ =
      MemoryMapping::Map(size, PROT_READ, MAP_PRIVATE, fd.get(), 0, path + ": cannot mmap");
  // On a throw, `file` unmaps.
  file.header_ = ParseSafetensorsHeader(file.mapping_.bytes(), size, path);
  return file;
}

SafetensorsFile::SafetensorsFile(SafetensorsFile&& other) noexcept = default;
SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& other) noexcept = default;
SafetensorsFile::~SafetensorsFile() = default;

const SafetensorsEntry* SafetensorsFile::Find(const std::string& name) const {
  for (const SafetensorsEntry& e : header_.tensors)
    if (e.name == name) return &e;
  return nullptr;
}

const uint8_t* SafetensorsFile::Data(const SafetensorsEntry& entry) const {
  LS_CHECK(header_.data_offset + entry.end <= mapping_.size(), "tensor " + entry.name);
  return mapping_.bytes() + header_.data_offset + entry.begin;
}

}  // namespace lorastream
