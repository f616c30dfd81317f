// The LM head's providers: resident on the device, or streamed from host RAM through a
// streaming-engine backend of one slot (the head's own, as large as the head), copied before
// the head is computed and freed right after; a compressed head either way stays compressed
// and is expanded per vocabulary slice into one scratch.
#include "worker/model/lm_head.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <vector>

#include <ATen/ATen.h>

#include "common/error.h"
#include "common/log.h"
#include "common/memory_mapping.h"
#include "store/shm_segment.h"
#include "worker/model/packed_weight.h"
#include "worker/stream/stream_backend.h"
#include "worker/stream/stream_budget.h"
#include "worker/stream/stream_engine.h"

namespace lorastream::worker {

namespace {

// A compressed head's vocabulary slices: each expanded from the head's bytes on the device
// into one scratch of slice_rows rows, freed at Release.
class PackedSlices {
 public:
  PackedSlices(const PackedWeight& w, c10::ScalarType dtype, int64_t slice_rows)
      : w_(w), dtype_(dtype) {
    const int64_t align = QuantRowAlignment(w.weight().quant, w.cols());
    const int64_t want =
        slice_rows > 0 ? slice_rows : HeadSliceRows(w.rows(), w.cols(), w.weight().quant);
    rows_ = std::min(w.rows(), (want + align - 1) / align * align);
    w_.bytes = at::Tensor();  // the bytes used are the caller's (on the device)
  }
  int64_t slice_rows() const { return rows_; }
  int64_t num_slices() const { return (w_.rows() + rows_ - 1) / rows_; }
  int64_t vocab() const { return w_.rows(); }
  at::Tensor Slice(const at::Tensor& bytes, int64_t i) {
    LS_CHECK(i >= 0 && i < num_slices(), "LM head slice out of range");
    const int64_t first = i * rows_, rows = std::min(rows_, w_.rows() - first);
    if (!scratch_.defined() || scratch_.device() != bytes.device())
      scratch_ = at::empty({rows_ * w_.cols()}, bytes.options().dtype(dtype_));
    at::Tensor out = scratch_.narrow(0, 0, rows * w_.cols()).view({rows, w_.cols()});
    ExpandPackedRows(w_, bytes, first, rows, out, &staging_);
    return out;
  }
  void Free() {
    scratch_ = at::Tensor();
    staging_ = at::Tensor();
  }

 private:
  PackedWeight w_;  // layout only
  c10::ScalarType dtype_;
  int64_t rows_ = 0;
  at::Tensor scratch_, staging_;
};

class ResidentHead : public HeadProvider {
 public:
  explicit ResidentHead(at::Tensor weight) : weight_(std::move(weight)) {}
  void Acquire() override {}
  at::Tensor Slice(int64_t i) override {
    LS_CHECK(i == 0, "a plain LM head is one slice");
    return weight_;
  }
  int64_t slice_rows() const override { return weight_.size(0); }
  int64_t vocab() const override { return weight_.size(0); }
  void Release() override {}

 private:
  at::Tensor weight_;
};

// Kept compressed on the device; each slice expanded when asked.
class ResidentPackedHead : public HeadProvider {
 public:
  ResidentPackedHead(const PackedWeight& w, c10::Device device, c10::ScalarType dtype,
                     int64_t slice_rows)
      : bytes_(w.bytes.to(device)), slices_(w, dtype, slice_rows) {
    LS_LOG_INFO("LM head: resident {} ({} bytes), expanded per slice of {} rows ({} of them)",
                QuantMethodName(w.weight().quant.method), w.bytes.nbytes(), slices_.slice_rows(),
                slices_.num_slices());
  }
  void Acquire() override {}
  at::Tensor Slice(int64_t i) override { return slices_.Slice(bytes_, i); }
  int64_t num_slices() const override { return slices_.num_slices(); }
  int64_t slice_rows() const override { return slices_.slice_rows(); }
  int64_t vocab() const override { return slices_.vocab(); }
  void Release() override { slices_.Free(); }

 private:
  at::Tensor bytes_;
  PackedSlices slices_;
};

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
  at::Tensor source_;  // keeps the host memory's owner alive (undefined when packed_ is used)
  MemoryMapping packed_;
  const std::vector<int64_t> shape_;
  const c10::ScalarType dtype_;
  std::optional<PackedSlices> slices_;  // a compressed head
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

at::Tensor WholeHead(HeadProvider& head) {
  if (head.num_slices() == 1) return head.Slice(0);
  std::vector<at::Tensor> slices;
  for (int64_t i = 0; i < head.num_slices(); ++i) slices.push_back(head.Slice(i).clone());
  return at::cat(slices);
}

std::unique_ptr<HeadProvider> MakeResidentHead(const at::Tensor& weight, c10::Device device,
                                               c10::ScalarType dtype) {
  return std::make_unique<ResidentHead>(weight.to(device, dtype));
}

std::unique_ptr<HeadProvider> MakeStreamedHead(const at::Tensor& host_weight, c10::Device device,
                                               c10::ScalarType dtype,
                                               const StreamEngineOptions& options) {
  return std::make_unique<StreamedHead>(host_weight, nullptr, device, dtype, options);
}

std::unique_ptr<HeadProvider> MakeResidentHead(const RestWeights& rest, c10::Device device,
                                               c10::ScalarType dtype, int64_t slice_rows) {
  if (rest.packed_head.defined())
    return std::make_unique<ResidentPackedHead>(rest.packed_head, device, dtype, slice_rows);
  LS_CHECK(rest.lm_head.defined(), "no LM head among the rest weights");
  return MakeResidentHead(rest.lm_head, device, dtype);
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
