// The LM head streamed from host RAM through a streaming-engine backend of one slot (the
// head's own, as large as the head), copied before the head is computed and freed right
// after; a compressed head stays compressed and is expanded per vocabulary slice.
#include "worker/stream/streamed_head.h"

#include <cstring>
#include <optional>
#include <vector>

#include <ATen/ATen.h>

#include "common/base/error.h"
#include "common/base/log.h"
#include "worker/stream/host_bytes.h"
#include "worker/stream/stream_backend.h"
#include "worker/stream/stream_engine.h"

namespace lorastream::worker {

namespace {

class StreamedHead : public HeadProvider {
 public:
  // A plain head: `host_weight` [vocab, hidden]. A compressed one (`packed`): its bytes as
  // they are, expanded per slice once copied.
  StreamedHead(const at::Tensor& host_weight, const PackedWeight* packed, c10::Device device,
               c10::ScalarType dtype, const StreamEngineOptions& options)
      : source_(packed ? packed->bytes : host_weight),
        shape_(packed ? packed->weight().shape : host_weight.sizes().vec()),
        dtype_(dtype) {
    if (!source_.device().is_cpu() || shape_.size() != 2)
      throw Error(ErrorCode::kInvalidArgument,
                  "a streamed LM head needs a [vocab, hidden] tensor in host RAM");
    if (packed != nullptr) {
      slices_.emplace(*packed, dtype, options.head_slice_rows);
      src_ = packed->bytes.data_ptr<uint8_t>();
      bytes_ = static_cast<uint64_t>(packed->bytes.nbytes());
    } else if (host_weight.scalar_type() == dtype && host_weight.is_contiguous()) {
      src_ = static_cast<const uint8_t*>(host_weight.data_ptr());
      bytes_ = static_cast<uint64_t>(host_weight.nbytes());
    } else {
      // Streaming serves bytes as they are: bring them into the compute dtype once, into
      // page-aligned memory made read-only once filled (as the packed blocks are).
      const at::Tensor converted = host_weight.to(dtype).contiguous();
      bytes_ = static_cast<uint64_t>(converted.nbytes());
      converted_ = HostBytes::Allocate(bytes_, "LM head");
      std::memcpy(converted_.data(), converted.data_ptr(), bytes_);
      converted_.MakeReadOnly();
      src_ = converted_.data();
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
    LS_LOG_INFO("LM head: streamed ({} bytes{} copied to {} for each use of the head)", bytes_,
                slices_ ? std::string(", compressed, expanded per slice of ") +
                              std::to_string(slices_->slice_rows()) + " rows (" +
                              std::to_string(slices_->num_slices()) + " of them)"
                        : std::string(),
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

  void Acquire() override {
    LS_CHECK(!acquired_, "LM head acquired twice without a release");
    Prefetch();
    backend_->AcquireSlot(0);
    in_flight_ = false;
    acquired_ = true;
    const at::Tensor slot = backend_->slot(0);
    weight_ =
        slices_ ? slot.narrow(0, 0, static_cast<int64_t>(bytes_)) : slot.view(dtype_).view(shape_);
  }

  at::Tensor Slice(int64_t i) override {
    LS_CHECK(acquired_, "LM head slice outside Acquire/Release");
    if (slices_) return slices_->Slice(weight_, i);
    LS_CHECK(i == 0, "a plain LM head is one slice");
    return weight_;
  }
  int64_t num_slices() const override { return slices_ ? slices_->num_slices() : 1; }
  int64_t slice_rows() const override { return slices_ ? slices_->slice_rows() : shape_[0]; }
  int64_t vocab() const override { return shape_[0]; }

  void Release() override {
    LS_CHECK(acquired_, "LM head released without an acquire");
    weight_ = at::Tensor();  // the view holds the slot's memory
    if (slices_) slices_->Free();
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
  at::Tensor source_;    // keeps the host memory's owner alive (undefined when packed_ is used)
  HostBytes converted_;  // a plain head converted to the compute dtype
  const std::vector<int64_t> shape_;
  const c10::ScalarType dtype_;
  std::optional<PackedHeadSlices> slices_;  // a compressed head
  const uint8_t* src_ = nullptr;
  uint64_t bytes_ = 0;
  std::unique_ptr<StreamBackend> backend_;  // after the host memory: destroyed first
  at::Tensor weight_;                       // the slot: the weights, or a compressed head's bytes
  bool acquired_ = false;
  bool in_flight_ = false;  // a copy issued and not yet acquired
  uint64_t h2d_bytes_ = 0;
  int64_t copies_ = 0;
};

}  // namespace

std::unique_ptr<HeadProvider> MakeStreamedHead(const at::Tensor& host_weight, c10::Device device,
                                               c10::ScalarType dtype,
                                               const StreamEngineOptions& options) {
  return std::make_unique<StreamedHead>(host_weight, nullptr, device, dtype, options);
}

std::unique_ptr<HeadProvider> MakeStreamedHead(const RestWeights& rest, c10::Device device,
                                               c10::ScalarType dtype,
                                               const StreamEngineOptions& options) {
  if (rest.packed_head.defined())
    return std::make_unique<StreamedHead>(at::Tensor(), &rest.packed_head, device, dtype, options);
  LS_CHECK(rest.lm_head.defined(), "no LM head among the rest weights");
  return MakeStreamedHead(rest.lm_head, device, dtype, options);
}

}  // namespace lorastream::worker
