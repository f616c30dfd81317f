// The LM head's resident providers (a streamed head's is worker/stream/streamed_head.cc); a
// compressed head stays compressed and is expanded per vocabulary slice into one scratch.
#include "worker/model/lm_head.h"

#include <algorithm>
#include <vector>

#include <ATen/ATen.h>

#include "common/base/error.h"
#include "common/base/log.h"
#include "worker/model/head_rows.h"
#include "worker/model/packed_weight.h"

namespace lorastream::worker {

PackedHeadSlices::PackedHeadSlices(const PackedWeight& w, c10::ScalarType dtype, int64_t slice_rows)
    : w_(w), dtype_(dtype) {
  const int64_t align = QuantRowAlignment(w.weight().quant, w.cols());
  const int64_t want =
      slice_rows > 0 ? slice_rows : HeadSliceRows(w.rows(), w.cols(), w.weight().quant);
  rows_ = std::min(w.rows(), (want + align - 1) / align * align);
  w_.bytes = at::Tensor();  // the bytes used are the caller's (on the device)
}

at::Tensor PackedHeadSlices::Slice(const at::Tensor& bytes, int64_t i) {
  LS_CHECK(i >= 0 && i < num_slices(), "LM head slice out of range");
  const int64_t first = i * rows_, rows = std::min(rows_, w_.rows() - first);
  if (!scratch_.defined() || scratch_.device() != bytes.device())
    scratch_ = at::empty({rows_ * w_.cols()}, bytes.options().dtype(dtype_));
  at::Tensor out = scratch_.narrow(0, 0, rows * w_.cols()).view({rows, w_.cols()});
  ExpandPackedRows(w_, bytes, first, rows, out, &staging_);
  return out;
}

void PackedHeadSlices::Free() {
  scratch_ = at::Tensor();
  staging_ = at::Tensor();
}

namespace {

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
  PackedHeadSlices slices_;
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

std::unique_ptr<HeadProvider> MakeResidentHead(const RestWeights& rest, c10::Device device,
                                               c10::ScalarType dtype, int64_t slice_rows) {
  if (rest.packed_head.defined())
    return std::make_unique<ResidentPackedHead>(rest.packed_head, device, dtype, slice_rows);
  LS_CHECK(rest.lm_head.defined(), "no LM head among the rest weights");
  return MakeResidentHead(rest.lm_head, device, dtype);
}

}  // namespace lorastream::worker
