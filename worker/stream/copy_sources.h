// Which way each streamed block's bytes reach the device (torch- and CUDA-free): straight
// from its host range when the range could be registered (full link speed), else through a
// pool of pinned staging buffers that a host thread fills (slower, but it works under a
// memlock limit). The CUDA backend (worker/stream/cuda/cuda_stream_backend.cc) asks this table and
// keeps the registrations it holds for its life; tests/worker/copy_sources_test.cc drives it
// with registrars that fail.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "worker/stream/host_registrar.h"

namespace lorastream::worker {

enum class CopyPath { kDirect, kStaged };

struct StagingPool {
  int buffers = 3;                             // pinned buffers in the pool
  uint64_t buffer_bytes = uint64_t{64} << 20;  // bytes per buffer
};

class CopySources {
 public:
  // force_staging: every source is staged, none registered (tests of the staging path).
  CopySources(HostRegistrar* registrar, bool force_staging, StagingPool pool);
  CopySources(const CopySources&) = delete;
  CopySources& operator=(const CopySources&) = delete;

  // A source's first Add registers it (unless staging is forced); one that cannot be
  // registered is staged. The first staged source logs why, once. Later Adds of the same
  // source return its path without registering again.
  CopyPath Add(const uint8_t* src, uint64_t bytes);
  // The path of a source added before (Error kInternal for one never added).
  CopyPath PathOf(const uint8_t* src) const;
  // The warning logged at the first staged source ("" while none is staged).
  const std::string& staging_reason() const { return staging_reason_; }

 private:
  HostRegistrar* const registrar_;
  const bool force_staging_;
  const StagingPool pool_;
  std::unordered_map<const uint8_t*, CopyPath> paths_;
  std::vector<std::unique_ptr<RegisteredRange>> registrations_;  // held until destruction
  std::string staging_reason_;
};

}  // namespace lorastream::worker
