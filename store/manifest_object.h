// The manifest's own shm object (/lorastream.NAME.manifest). Two-phase publication:
// the store CLAIMS the name first (the object exists, state "loading", with the owner's pid,
// so a second store of the same name is refused), creates and fills every segment, then
// PUBLISHES: writes the manifest JSON and only then flips the state to "published". Readers
// never trust an unpublished object; the store writes nothing after publishing.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>

#include "common/formats/manifest.h"
#include "common/posix/unique_fd.h"

namespace lorastream::store {

enum class ManifestState : uint32_t { kLoading = 0, kPublished = 1 };

// What a reader finds under a store name.
struct ManifestRecord {
  ManifestState state = ManifestState::kLoading;
  int64_t owner_pid = 0;
  uint64_t owner_start_time = 0;
  uid_t owner_uid = 0;  // the user the object belongs to (who serves the store)
  std::string json;     // empty unless published
};

// Reads the manifest object of `store_name`; nullopt when there is none. An object still
// being written (shorter than its header) reads as kLoading with owner_pid 0.
std::optional<ManifestRecord> ReadManifestObject(const std::string& store_name);

// The owner side (RAII, move-only): unlinks the object when destroyed.
class ManifestClaim {
 public:
  // Creates the object exclusively with `mode`; Error(kRefused) when it already exists.
  static ManifestClaim Claim(const std::string& store_name, mode_t mode);
  ManifestClaim(ManifestClaim&& other) noexcept;
  ManifestClaim& operator=(ManifestClaim&&) = delete;
  ManifestClaim(const ManifestClaim&) = delete;
  ~ManifestClaim();

  void Publish(const Manifest& manifest);
  // Unlinks now (teardown order: segments first, the manifest last).
  void Release() noexcept;

 private:
  ManifestClaim() = default;
  std::string shm_name_;
  UniqueFd fd_;  // holding it is holding the claim: Release() unlinks the name
};

}  // namespace lorastream::store
