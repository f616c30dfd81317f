// SHA-256 (FIPS 180-4), written here so that common/ needs no crypto library. Used for the
// checksums of checkpoint files (common/formats/checkpoint_manifest.h), where a flipped low bit of
// any byte must change the digest.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace lorastream {

class Sha256 {
 public:
  Sha256();
  void Update(const void* data, size_t n);
  // The digest as 64 lowercase hex characters; the object must not be updated afterwards.
  std::string HexDigest();

 private:
  void Compress(const uint8_t* block);
  uint32_t h_[8];
  uint64_t length_ = 0;  // bytes fed so far
  uint8_t buffer_[64];
  size_t buffered_ = 0;
};

// SHA-256 of a file's contents as hex; throws Error(kIo) naming the file when unreadable.
std::string Sha256OfFile(const std::string& path);

}  // namespace lorastream
