// Block checksums: XXH64 (written here; bit-compatible with the reference xxHash), and a
// chunked form that threads can compute in parallel over a multi-GiB segment.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace lorastream::store {

// XXH64 of `n` bytes (the reference algorithm; XXH64("", 0) == 0xEF46DB3751D8E999).
uint64_t Xxh64(const void* data, size_t n, uint64_t seed = 0);

// A fast 64-bit hash for bulk data (the XXH3 accumulate/scramble construction, written
// here: eight 64-bit lanes fed by 32x32->64 multiplies, SSE2 where available, scalar
// elsewhere, both giving the same value). Not bit-compatible with XXH3; used for chunks of
// segment checksums, where XXH64's multiply chain would make hashing slower than copying.
uint64_t BulkHash64(const void* data, size_t n);

// BulkHash64 fed piece by piece (so that a loader hashes each piece while it is in cache):
// every Update but the last must be a multiple of kBulkHashBlock bytes.
constexpr size_t kBulkHashBlock = 1024;
class BulkHasher {
 public:
  BulkHasher();
  void Update(const void* data, size_t n);
  uint64_t Finish() const;

 private:
  alignas(16) uint64_t acc_[8];
  uint64_t length_ = 0;
  uint8_t tail_[64];
  size_t tail_size_ = 0;
};

// Chunk size of SegmentChecksum; part of the checksum's definition, never change it.
constexpr size_t kChecksumChunkBytes = 4u << 20;

// The checksum a manifest records for a segment: XXH64 (seed = n) over the little-endian
// BulkHash64 values of each kChecksumChunkBytes chunk. `threads` > 1 hashes chunks in parallel;
// the result does not depend on it.
uint64_t SegmentChecksum(const uint8_t* data, size_t n, int threads = 1);

// Combines the chunk hashes of a segment of `n` bytes into its SegmentChecksum (for callers
// that hash chunks themselves, e.g. the loader while each chunk is still in cache).
uint64_t CombineChunkHashes(const std::vector<uint64_t>& chunk_hashes, size_t n);

}  // namespace lorastream::store
