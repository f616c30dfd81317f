// `lorastream-store serve`: load a checkpoint, pack it into per-block shm segments, lock and
// publish it, stay up until SIGTERM/SIGINT, then unlink everything.
#pragma once

#include <sys/types.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/formats/manifest.h"
#include "store/manifest_object.h"
#include "store/shm_segment.h"

namespace lorastream::store {

class Progress;

struct ServeOptions {
  std::string model_dir;
  std::string name;
  bool to_bf16 = false;    // --dtype bf16: convert F32/F16 to BF16 (keep: the file's dtype)
  int threads = 0;         // loader threads; 0: one per hardware thread
  mode_t mode = 0600;      // segment permissions: owner-only unless asked otherwise
  bool lock = true;        // mlock the segments (warns once with the fix when refused)
  bool huge_pages = true;  // madvise(MADV_HUGEPAGE) where the kernel offers shmem THP
  // --quantize fp8|nf4: the blocks' projection weights stored compressed (quantised at load,
  // on every loader thread); kNone: as the checkpoint holds them.
  QuantMethod quantize = QuantMethod::kNone;
  // --quantize-head / --quantize-embedding: the LM head (a tied model's one table) and the
  // untied embedding table stored in that format too (store/layout.h PackOptions).
  bool quantize_head = false;
  bool quantize_embedding = false;
};

// Blocks SIGTERM/SIGINT, builds and publishes, waits for one of them, tears down.
// Returns the exit status (0).
int RunServe(const ServeOptions& options);

struct LoadReport {
  uint64_t bytes = 0;
  uint64_t source_bytes = 0;            // of the checkpoint's tensors the store is made from
  double check_seconds = 0;             // reading every weight for NaN/infinity
  double prefault_seconds = 0;          // creating, reserving and prefaulting the segments
  double load_seconds = 0;              // copying (and converting) from the page cache + checksums
  size_t quantized_weights = 0;         // projection weights quantised at load (0: none)
  uint64_t quantized_source_bytes = 0;  // their bytes in the checkpoint
  double quantize_seconds = 0;          // quantising them into the segments
  double total_seconds = 0;             // from the first file opened to the manifest published
  int threads = 0;
  bool locked = false;
};

// The load's one summary line: bytes, time and GB/s, each phase's time, and with quantising,
// its time against the reading's.
std::string DescribeLoad(const LoadReport& report, QuantMethod quantize);

// A packed and published store (RAII, move-only through unique_ptr): destroying it unlinks
// the segments, then the manifest. Attachers keep their mappings.
class PublishedStore {
 public:
  // Validates everything before creating any shm object; a failure leaves nothing behind.
  // `should_stop` is polled while loading, from several threads at once (Error(kCancelled)
  // when it returns true). `progress` (optional) gets the load's phases: checking weights,
  // allocating, quantising (with --quantize), reading.
  static std::unique_ptr<PublishedStore> Build(const ServeOptions& options,
                                               const std::function<bool()>& should_stop = {},
                                               Progress* progress = nullptr);
  ~PublishedStore();
  const Manifest& manifest() const { return manifest_; }
  const LoadReport& report() const { return report_; }

 private:
  PublishedStore() = default;
  std::unique_ptr<ManifestClaim> claim_;  // declared first: destroyed (unlinked) last
  std::vector<ShmSegment> segments_;
  Manifest manifest_;
  LoadReport report_;
};

// The fingerprint of a manifest's weights: config, dtype and every tensor's layout and
// segment checksum (independent of store name, generation and owner).
std::string ComputeFingerprint(const Manifest& manifest);

}  // namespace lorastream::store
