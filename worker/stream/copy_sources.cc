#include "worker/stream/copy_sources.h"

#include "common/base/error.h"
#include "common/base/log.h"

namespace lorastream::worker {

CopySources::CopySources(HostRegistrar* registrar, bool force_staging, StagingPool pool)
    : registrar_(registrar), force_staging_(force_staging), pool_(pool) {}

CopyPath CopySources::Add(const uint8_t* src, uint64_t bytes) {
  if (auto it = paths_.find(src); it != paths_.end()) return it->second;
  CopyPath path = CopyPath::kStaged;
  std::string error;
  if (!force_staging_) {
    if (std::unique_ptr<RegisteredRange> r = registrar_->Register(src, bytes, &error)) {
      registrations_.push_back(std::move(r));
      path = CopyPath::kDirect;
    }
  }
  if (path == CopyPath::kStaged && staging_reason_.empty()) {
    const std::string pool = std::to_string(pool_.buffers) + " pinned staging buffers of " +
                             std::to_string(pool_.buffer_bytes >> 20) +
                             " MiB filled by a host thread";
    staging_reason_ = force_staging_
                          ? "stream engine: force_staging: every copy goes through " + pool
                          : "stream engine: cudaHostRegister of a " +
                                std::to_string(bytes / 1000000) + " MB block failed: " + error +
                                "; copies of unregistered blocks go through " + pool +
                                " (slower; raise `ulimit -l` to stream at full speed)";
    LS_LOG_WARN("{}", staging_reason_);
  }
  paths_.emplace(src, path);
  return path;
}

CopyPath CopySources::PathOf(const uint8_t* src) const {
  auto it = paths_.find(src);
  LS_CHECK(it != paths_.end(), "copy from a source that was never added");
  return it->second;
}

}  // namespace lorastream::worker
