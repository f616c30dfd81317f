// Attaching to a published store (torch-free; used by workers and `lorastream-store verify`).
//
//   AttachedStore store = AttachedStore::Attach("llama", expected_fingerprint);
//   const Manifest& m = store.manifest();            // config, dtype, per-block layout
//   const uint8_t* block = store.block_data(3);      // block_size(3) bytes, one H2D copy
//   const TensorSlice* q = m.blocks[3].Find("self_attn.q_proj.weight");
//   const uint8_t* q_bytes = block + q->offset;      // q->shape, q->dtype; offsets are
//                                                    // multiples of m.alignment (256)
// Every segment is mapped PROT_READ | MAP_SHARED: a write through any pointer handed out
// here raises SIGSEGV, so nothing a worker does changes the base for others. The mappings
// stay valid while this object lives, even after the store exits or unlinks its segments.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/formats/manifest.h"
#include "store/shm_segment.h"

namespace lorastream::store {

// Stores are trusted only when they belong to the expected user: the user who serves a store
// can rewrite its segments under every job that trains on them. The expected user is this
// process's effective uid unless set here (the worker's `--store-user NAME`). Process-wide:
// one worker trusts one store user.
void SetTrustedStoreOwner(uid_t uid);
uid_t TrustedStoreOwner();

class AttachedStore {
 public:
  // Finds store `name`, checks it is published and its owner alive, checks the fingerprint
  // (when `expected_fingerprint` is not empty) and maps every segment read-only. `populate`
  // prefaults the page tables (faster first touch; no extra memory: the pages are shared).
  // The manifest and every segment must belong to TrustedStoreOwner() (fstat on the open
  // object, before it is mapped). Errors: kNotFound (no such store / stale / still loading),
  // kRefused (fingerprint mismatch; a manifest or segment of another user, named with its
  // owner and the expected user), kCorrupt (manifest or segment inconsistent).
  static AttachedStore Attach(const std::string& name, const std::string& expected_fingerprint = "",
                              bool populate = false);
  // Like Attach, but retries kNotFound until `timeout_seconds` pass (a store still loading).
  static AttachedStore AttachWhenReady(const std::string& name, double timeout_seconds,
                                       const std::string& expected_fingerprint = "");

  AttachedStore(AttachedStore&&) noexcept = default;
  AttachedStore& operator=(AttachedStore&&) noexcept = default;
  AttachedStore(const AttachedStore&) = delete;
  AttachedStore& operator=(const AttachedStore&) = delete;

  const Manifest& manifest() const { return manifest_; }
  int num_blocks() const { return static_cast<int>(blocks_.size()); }
  const uint8_t* block_data(int i) const;  // i in [0, num_blocks())
  size_t block_size(int i) const;          // == manifest().blocks[i].nbytes
  const uint8_t* rest_data() const { return rest_.data(); }
  size_t rest_size() const { return manifest_.rest.nbytes; }
  // Page-rounded lengths of the mappings (what cudaHostRegister should be given; the bytes
  // past *_size() are zero). Mappings start page-aligned.
  size_t block_mapped_size(int i) const;
  size_t rest_mapped_size() const { return rest_.mapped_size(); }
  // Bytes of one tensor: `block` >= 0 with a block-relative name ("mlp.up_proj.weight"), or
  // block == -1 with a full rest name ("model.embed_tokens.weight"); nullptr when absent.
  const uint8_t* tensor_data(int block, const std::string& name) const;

 private:
  AttachedStore() = default;
  Manifest manifest_;
  std::vector<ShmSegment> blocks_;
  ShmSegment rest_;
};

// Recomputes every segment's checksum (`threads` in parallel) through the read-only mapping.
// Throws Error(kCorrupt) naming every segment whose bytes do not match the manifest.
void VerifyChecksums(const AttachedStore& store, int threads = 1);

}  // namespace lorastream::store
