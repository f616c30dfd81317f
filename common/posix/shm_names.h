// Names of a store's POSIX shared-memory objects. Every object of store NAME starts with
// "lorastream.NAME." so that `ls`, stale clean-up and /proc/PID/maps scans find them by prefix:
//   /lorastream.NAME.manifest            the manifest (claimed first, published last)
//   /lorastream.NAME.GEN.block.0007      block 7 of generation GEN (16 hex digits)
//   /lorastream.NAME.GEN.rest            embeddings, final norm, lm_head
#pragma once

#include <cstdint>
#include <string>

namespace lorastream {

// Where Linux exposes POSIX shm objects as files (used to list them and check free space).
constexpr const char* kShmDir = "/dev/shm";

// Throws Error(kInvalidArgument) unless `name` is 1..64 characters of [A-Za-z0-9_-]
// (no dots: the prefix of one store must never be the prefix of another).
void ValidateStoreName(const std::string& name);

std::string ShmPrefix(const std::string& store_name);  // "lorastream.NAME." (no slash)
std::string ManifestShmName(const std::string& store_name);
std::string BlockShmName(const std::string& store_name, uint64_t generation, int block);
std::string RestShmName(const std::string& store_name, uint64_t generation);

// A store a worker offers, as `lorastream-worker serve --store [AS=]NAME` names it: the store
// NAME of this host, offered to the jobs whose model.store is AS (NAME itself without AS).
// A Slurm pilot's stores carry their node and job in NAME, so that two of them never collide
// on one host, while every node offers its own under the one name the jobs give.
struct StoreOffer {
  std::string name;        // the store attached here
  std::string offered_as;  // what jobs call it
};
// Throws Error(kInvalidArgument) naming the text when either name is not a valid store name.
StoreOffer ParseStoreOffer(const std::string& text);

}  // namespace lorastream
