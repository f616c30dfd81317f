#include "store/registry.h"

#include <dirent.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <map>

#include "common/base/error.h"
#include "common/base/log.h"
#include "common/formats/manifest.h"
#include "common/formats/quant_format.h"
#include "common/posix/shm_names.h"
#include "common/posix/user_access.h"
#include "store/process.h"

namespace lorastream::store {

namespace {

std::vector<ShmObject> ObjectsWithPrefix(const std::string& prefix) {
  std::vector<ShmObject> objects;
  DIR* dir = ::opendir(kShmDir);
  if (!dir) return objects;
  while (dirent* e = ::readdir(dir)) {
    const std::string name = e->d_name;
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    struct stat st {};
    const std::string path = std::string(kShmDir) + "/" + name;
    ShmObject object{"/" + name, 0};
    if (::stat(path.c_str(), &st) == 0) object.bytes = static_cast<uint64_t>(st.st_size);
    objects.push_back(object);
  }
  ::closedir(dir);
  std::sort(objects.begin(), objects.end(),
            [](const ShmObject& a, const ShmObject& b) { return a.name < b.name; });
  return objects;
}

}  // namespace

std::vector<ShmObject> ShmObjectsOf(const std::string& store_name) {
  return ObjectsWithPrefix(ShmPrefix(store_name));
}

std::vector<StoreListing> ListStores() {
  std::map<std::string, StoreListing> stores;
  for (const ShmObject& object : ObjectsWithPrefix("lorastream.")) {
    // "/lorastream.NAME.rest" -> NAME (store names hold no dots).
    const size_t begin = std::string("/lorastream.").size();
    const size_t dot = object.name.find('.', begin);
    if (dot == std::string::npos) continue;
    const std::string name = object.name.substr(begin, dot - begin);
    StoreListing& listing = stores[name];
    listing.name = name;
    listing.objects.push_back(object);
  }
  std::vector<StoreListing> out;
  for (auto& [name, listing] : stores) {
    try {
      listing.record = ReadManifestObject(name);
    } catch (const Error& e) {
      // Another user's owner-only manifest: there, but not ours to read.
      struct stat st {};
      const std::string path = std::string(kShmDir) + ManifestShmName(name);
      if (::stat(path.c_str(), &st) == 0 && st.st_uid != ::geteuid() &&
          ::access(path.c_str(), R_OK) != 0)
        listing.unreadable_owner_uid = st.st_uid;
      else
        LS_LOG_WARN("store {}: {}", name, e.what());
    }
    listing.alive =
        listing.record && ProcessAlive(listing.record->owner_pid, listing.record->owner_start_time);
    listing.mapping_pids = PidsMapping(ShmPrefix(name));
    out.push_back(std::move(listing));
  }
  return out;
}

int RemoveStaleStore(const std::string& store_name) {
  ValidateStoreName(store_name);
  // A name held by another user's object that we cannot even read: say whose it is.
  const std::string manifest_path =
      std::string(kShmDir) + "/" + ManifestShmName(store_name).substr(1);
  struct stat st {};
  const bool exists = ::stat(manifest_path.c_str(), &st) == 0;
  std::optional<ManifestRecord> record;
  try {
    record = ReadManifestObject(store_name);
  } catch (const Error& e) {
    if (!exists || st.st_uid == ::geteuid()) throw;
    throw Error(ErrorCode::kRefused, "store name `" + store_name + "` is held by " +
                                         DescribeUser(st.st_uid) + " (" + manifest_path +
                                         "): ask them to stop their store, or have root remove " +
                                         std::string(kShmDir) + "/" + ShmPrefix(store_name) +
                                         "* if it is stale; or choose another --name");
  }
  if (record && ProcessAlive(record->owner_pid, record->owner_start_time)) {
    const std::string pid = std::to_string(record->owner_pid);
    if (record->owner_uid != ::geteuid())
      throw Error(ErrorCode::kRefused,
                  "store name `" + store_name + "` is held by " + DescribeUser(record->owner_uid) +
                      ", whose store pid " + pid +
                      " serves it; workers of other users will not attach it. Ask them to "
                      "stop it (or, as root, kill " +
                      pid + "), or choose another --name");
    throw Error(ErrorCode::kRefused, "store `" + store_name + "` is already served by pid " + pid +
                                         "; stop it first (kill " + pid +
                                         ") or choose another --name");
  }
  const std::vector<ShmObject> objects = ShmObjectsOf(store_name);
  for (const ShmObject& object : objects) ::shm_unlink(object.name.c_str());
  if (!objects.empty())
    LS_LOG_WARN("removed {} stale shared-memory objects of store `{}` (owner pid {} is gone)",
                objects.size(), store_name, record ? record->owner_pid : 0);
  return static_cast<int>(objects.size());
}

std::string StoreStateName(const StoreListing& s) {
  if (!s.record && s.unreadable_owner_uid >= 0)
    return "not readable by you (owner uid " + std::to_string(s.unreadable_owner_uid) + ")";
  if (!s.record) return "orphaned (no manifest)";
  if (!s.alive) return "stale (owner gone)";
  return s.record->state == ManifestState::kPublished ? "published" : "loading";
}

uint64_t StoreBytes(const StoreListing& s) {
  uint64_t bytes = 0;
  for (const ShmObject& o : s.objects) bytes += o.bytes;
  return bytes;
}

std::string StoreFormat(const StoreListing& s) {
  if (!s.record || s.record->json.empty()) return "";
  try {
    const Manifest m = ManifestFromJson(s.record->json, "store `" + s.name + "`");
    return (m.is_flux()         ? "flux, " + std::to_string(m.blocks.size()) + " units, "
            : m.is_qwen_image() ? "qwen_image, " + std::to_string(m.blocks.size()) + " blocks, "
                                : std::string()) +
           std::string(DTypeName(m.dtype)) + m.DescribeCompression();
  } catch (const Error& e) {
    return std::string("unreadable manifest (") + e.what() + ")";
  }
}

uint64_t StorePssBytes(const StoreListing& s) {
  uint64_t pss = 0;
  for (int64_t pid : s.mapping_pids) pss += ShmMappingUseOf(pid, ShmPrefix(s.name)).pss_bytes;
  return pss;
}

std::vector<int64_t> AttachedPids(const StoreListing& s) {
  std::vector<int64_t> attached;
  for (int64_t pid : s.mapping_pids)
    if (!s.record || pid != s.record->owner_pid) attached.push_back(pid);
  return attached;
}

}  // namespace lorastream::store
