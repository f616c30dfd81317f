// What lives in /dev/shm: the stores, their objects, who maps them; and removal of the
// objects a dead store left behind.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "store/manifest_object.h"

namespace lorastream::store {

struct ShmObject {
  std::string name;  // "/lorastream.NAME...."
  uint64_t bytes = 0;
};

struct StoreListing {
  std::string name;
  std::optional<ManifestRecord> record;  // absent: orphaned segments without a manifest
  // >= 0 when the manifest exists but this user may not read it (another user's store, made
  // owner-only): its owner's uid. Such a store is not orphaned, only not ours to inspect.
  int64_t unreadable_owner_uid = -1;
  bool alive = false;                 // the owner process is running
  std::vector<ShmObject> objects;     // every shm object of the store, manifest included
  std::vector<int64_t> mapping_pids;  // processes mapping one of its objects (owner too)
};

// Every shm object whose name starts with ShmPrefix(store_name).
std::vector<ShmObject> ShmObjectsOf(const std::string& store_name);

// All stores found in /dev/shm, sorted by name.
std::vector<StoreListing> ListStores();

// "published", "loading", "stale (owner gone)", "not readable by you (owner uid N)" or
// "orphaned (no manifest)".
std::string StoreStateName(const StoreListing& store);

// Total bytes of the store's shm objects.
uint64_t StoreBytes(const StoreListing& store);

// What the store holds, from its manifest: "bf16", "f32, blocks fp8 (e4m3, 128x128 scales)";
// "unreadable manifest (why)" when it cannot be read; "" without a manifest.
std::string StoreFormat(const StoreListing& store);

// The RAM the store's mappings take: the Pss of every process mapping it, summed (its
// bytes once however many processes attach it; only the processes this user may inspect).
uint64_t StorePssBytes(const StoreListing& store);

// Processes mapping the store other than its owner.
std::vector<int64_t> AttachedPids(const StoreListing& store);

// Before a store of `store_name` starts: when a live store holds the name, throws
// Error(kRefused) naming its pid; otherwise unlinks every object left by a dead one and
// returns how many were removed.
int RemoveStaleStore(const std::string& store_name);

}  // namespace lorastream::store
