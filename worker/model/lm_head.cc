// The LM head's providers: resident on the device, or streamed from host RAM through a
// streaming-engine backend of one slot (the head's own, as large as the head), copied before
// the head is computed and freed right after.
#include "worker/model/lm_head.h"

#include <sys/mman.h>

#include <cstring>
#include <vector>

#include <ATen/ATen.h>

#include "common/error.h"
#include "common/log.h"
#include "common/memory_mapping.h"
#include "store/shm_segment.h"
#include "worker/stream/stream_backend.h"
#include "worker/stream/stream_engine.h"

namespace lorastream::worker {

namespace {

class ResidentHead : public HeadProvider {
 public:
  explicit ResidentHead(at::Tensor weight) : weight_(std::move(weight)) {}
  const at::Tensor& Acquire() override { return weight_; }
  void Release() override {}

 private:
  at::Tensor weight_;
};

class StreamedHead : public HeadProvider {
 public:
  StreamedHead(const at::Tensor& host_weight, c10::Device device, c10::ScalarType dtype,
               const StreamEngineOptions& options)
      : source_(host_weight), shape_(host_weight.sizes().vec()), dtype_(dtype) {
    if (!host_weight.device().is_cpu() || host_weight.dim() != 2)
      throw Error(ErrorCode::kInvalidArgument,
                  "a streamed LM head needs a [vocab, hidden] tensor in host RAM");
    if (host_weight.scalar_type() == dtype && host_weight.is_contiguous()) {
      src_ = static_cast<const uint8_t*>(host_weight.data_ptr());
      bytes_ = static_cast<uint64_t>(host_weight.nbytes());
    } else {
      // Streaming serves bytes as they are: bring them into the compute dtype once, into
      // page-aligned memory made read-only once filled (as the packed blocks are).
      const at::Tensor converted = host_weight.to(dtype).contiguous();
      bytes_ = static_cast<uint64_t>(converted.nbytes());
      const size_t mapped = store::RoundUpToPage(bytes_);
      packed_ = MemoryMapping::Map(mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1,
                                   0, "LM head: mapping " + std::to_string(mapped) + " bytes");
      std::memcpy(packed_.bytes(), converted.data_ptr(), bytes_);
      if (mprotect(packed_.data(), mapped, PROT_READ) != 0) ThrowErrno("LM head: mprotect");
      src_ = packed_.bytes();
      source_ = at::Tensor();  // the converted copy is what is streamed
    }
    StreamBackendOptions b;
    b.num_slots = 1;
    b.permanent_slots = 0;  // allocated by each copy, freed after each use
    b.slot_bytes = bytes_;
    b.debug_poison = options.debug_poison;
    b.debug_copy_delay_us = options.debug_copy_delay_us;
    b.force_staging = options.force_staging;
    backend_ = MakeStreamBackend(b, device);
    backend_->AddSource(src_, bytes_);
    LS_LOG_INFO("LM head: streamed ({} bytes copied to {} for each use of the head)", bytes_,
                device.str());
  }

  ~StreamedHead() override {
    try {
      backend_->Drain();  // no copy may still write the slot while the backend frees it
    } catch (const std::exception& e) {
      LS_LOG_WARN("LM head: a copy failed during shutdown: {}", e.what());
    }
  }

  void Prefetch() override {
    LS_CHECK(!acquired_, "LM head prefetched while acquired");
    if (in_flight_) return;
    backend_->Copy(0, src_, bytes_);
    in_flight_ = true;
    h2d_bytes_ += bytes_;
    ++copies_;
  }

  const at::Tensor& Acquire() override {
    LS_CHECK(!acquired_, "LM head acquired twice without a release");
    Prefetch();
    backend_->AcquireSlot(0);
    in_flight_ = false;
    acquired_ = true;
    weight_ = backend_->slot(0).view(dtype_).view(shape_);
    return weight_;
  }

  void Release() override {
    LS_CHECK(acquired_, "LM head released without an acquire");
    weight_ = at::Tensor();  // the view holds the slot's memory
    backend_->ReleaseSlot(0);
    backend_->FreeSlot(0);
    acquired_ = false;
  }

  void CollectStats(StepStats& stats) override {
    double busy = 0, stall = 0;
    backend_->CollectTimes(&busy, &stall);
    stats.h2d_bytes += h2d_bytes_;
    stats.copies += copies_;
    stats.h2d_busy_seconds += busy;
    stats.stall_seconds += stall;
    h2d_bytes_ = 0;
    copies_ = 0;
  }

  bool streamed() const override { return true; }

 private:
  at::Tensor source_;  // keeps the host memory's owner alive (undefined when packed_ is used)
  MemoryMapping packed_;
  const std::vector<int64_t> shape_;
  const c10::ScalarType dtype_;
  const uint8_t* src_ = nullptr;
  uint64_t bytes_ = 0;
  std::unique_ptr<StreamBackend> backend_;  // after the host memory: destroyed first
  at::Tensor weight_;
  bool acquired_ = false;
  bool in_flight_ = false;  // a copy issued and not yet acquired
  uint64_t h2d_bytes_ = 0;
  int64_t copies_ = 0;
};

}  // namespace

std::unique_ptr<HeadProvider> MakeResidentHead(const at::Tensor& weight, c10::Device device,
                                               c10::ScalarType dtype) {
  return std::make_unique<ResidentHead>(weight.to(device, dtype));
}

std::unique_ptr<HeadProvider> MakeStreamedHead(const at::Tensor& host_weight, c10::Device device,
                                               c10::ScalarType dtype,
                                               const StreamEngineOptions& options) {
  return std::make_unique<StreamedHead>(host_weight, device, dtype, options);
}

}  // namespace lorastream::worker
