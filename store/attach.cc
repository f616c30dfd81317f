#include "store/attach.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <thread>

#include "common/base/error.h"
#include "common/posix/shm_names.h"
#include "common/posix/user_access.h"
#include "store/checksum.h"
#include "store/manifest_object.h"
#include "store/process.h"

namespace lorastream::store {

namespace {
std::atomic<int64_t> g_trusted_owner{-1};  // -1: the effective uid
}  // namespace

void SetTrustedStoreOwner(uid_t uid) { g_trusted_owner = uid; }

uid_t TrustedStoreOwner() {
  int64_t uid = g_trusted_owner.load();
  return uid < 0 ? ::geteuid() : static_cast<uid_t>(uid);
}

AttachedStore AttachedStore::Attach(const std::string& name,
                                    const std::string& expected_fingerprint, bool populate) {
  ValidateStoreName(name);
  const std::string shm = ManifestShmName(name);
  std::optional<ManifestRecord> record = ReadManifestObject(name);
  if (!record)
    throw Error(ErrorCode::kNotFound, "no store named `" + name + "` (" + shm +
                                          " does not exist); start one with "
                                          "`lorastream-store serve MODEL_DIR --name " +
                                          name + "`");
  const uid_t trusted = TrustedStoreOwner();
  if (record->owner_uid != trusted)
    throw Error(ErrorCode::kRefused,
                "store `" + name + "`: its manifest " + shm + " belongs to " +
                    DescribeUser(record->owner_uid) + ", not to the expected store user " +
                    DescribeUser(trusted) +
                    " (another user could rewrite the weights under a running job); attach "
                    "stores of your own user, or name the user that serves them with "
                    "--store-user");
  if (!ProcessAlive(record->owner_pid, record->owner_start_time))
    throw Error(ErrorCode::kNotFound, "store `" + name + "` is stale: its owner pid " +
                                          std::to_string(record->owner_pid) +
                                          " is gone; restart it");
  if (record->state != ManifestState::kPublished)
    throw Error(ErrorCode::kNotFound, "store `" + name + "` is still loading (pid " +
                                          std::to_string(record->owner_pid) + ")");
  AttachedStore store;
  store.manifest_ = ManifestFromJson(record->json, shm);
  const Manifest& m = store.manifest_;
  if (!expected_fingerprint.empty() && m.fingerprint != expected_fingerprint)
    throw Error(ErrorCode::kRefused, "store `" + name + "` holds weights with fingerprint " +
                                         m.fingerprint + ", expected " + expected_fingerprint);
  try {
    for (const SegmentInfo& b : m.blocks)
      store.blocks_.push_back(ShmSegment::OpenReadOnly(b.shm_name, b.nbytes, populate, trusted));
    store.rest_ = ShmSegment::OpenReadOnly(m.rest.shm_name, m.rest.nbytes, populate, trusted);
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kRefused) throw;
    throw Error(e.code(), "store `" + name + "`: " + e.what());
  }
  return store;
}

AttachedStore AttachedStore::AttachWhenReady(const std::string& name, double timeout_seconds,
                                             const std::string& expected_fingerprint) {
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_seconds);
  while (true) {
    try {
      return Attach(name, expected_fingerprint);
    } catch (const Error& e) {
      if (e.code() != ErrorCode::kNotFound || std::chrono::steady_clock::now() >= deadline) throw;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

const uint8_t* AttachedStore::block_data(int i) const {
  LS_CHECK(i >= 0 && i < num_blocks(), "block " + std::to_string(i));
  return blocks_[i].data();
}

size_t AttachedStore::block_size(int i) const {
  LS_CHECK(i >= 0 && i < num_blocks(), "block " + std::to_string(i));
  return manifest_.blocks[i].nbytes;
}

size_t AttachedStore::block_mapped_size(int i) const {
  LS_CHECK(i >= 0 && i < num_blocks(), "block " + std::to_string(i));
  return blocks_[i].mapped_size();
}

const uint8_t* AttachedStore::tensor_data(int block, const std::string& name) const {
  const SegmentInfo& info = block < 0 ? manifest_.rest : manifest_.blocks.at(block);
  const TensorSlice* slice = info.Find(name);
  if (!slice) return nullptr;
  return (block < 0 ? rest_data() : block_data(block)) + slice->offset;
}

void VerifyChecksums(const AttachedStore& store, int threads) {
  const Manifest& m = store.manifest();
  std::string bad;
  auto check = [&](const SegmentInfo& info, const uint8_t* data, const std::string& what) {
    const uint64_t actual = SegmentChecksum(data, info.nbytes, threads);
    if (actual != info.checksum) {
      char buf[96];
      std::snprintf(buf, sizeof(buf), " (checksum %016" PRIx64 ", manifest says %016" PRIx64 ")",
                    actual, info.checksum);
      bad += (bad.empty() ? "" : "; ") + what + buf;
    }
  };
  for (int i = 0; i < store.num_blocks(); ++i)
    check(m.blocks[i], store.block_data(i), "block " + std::to_string(i));
  check(m.rest, store.rest_data(), "rest");
  if (!bad.empty())
    throw Error(ErrorCode::kCorrupt, "store `" + m.store_name + "`: checksum mismatch in " + bad);
}

}  // namespace lorastream::store
