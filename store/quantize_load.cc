// QuantizeSegments (store/loader.h): the compressed weights of a `--quantize` store, computed
// from the checkpoint's mapping straight into the segments.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <vector>

#include "common/base/error.h"
#include "store/convert.h"
#include "store/loader.h"
#include "store/parallel.h"
#include "store/progress.h"
#include "store/quantize.h"

namespace lorastream::store {

namespace {

// Elements per piece of nf4 work (a multiple of every even blocksize up to 2^20).
constexpr int64_t kNf4PieceElements = int64_t{1} << 21;

// One piece of work: rows [row0, row1) of an fp8 weight, or elements [begin, end) of an nf4 one.
struct Piece {
  size_t task;
  int64_t begin, end;
};

// Elements [begin, begin + count) of a weight whose row runs are `sources`, as f32 into
// `out`; returns the source bytes read.
uint64_t ReadElements(const std::vector<Checkpoint::Ref>& sources, int64_t begin, int64_t count,
                      float* out) {
  uint64_t bytes = 0;
  for (const Checkpoint::Ref& src : sources) {
    const int64_t n = static_cast<int64_t>(src.entry->numel());
    if (begin >= n) {
      begin -= n;
      continue;
    }
    const int64_t take = std::min(count, n - begin);
    const DType dtype = src.entry->dtype;
    ConvertToFloat(dtype, src.file->Data(*src.entry) + begin * DTypeSize(dtype), out,
                   static_cast<size_t>(take));
    bytes += static_cast<uint64_t>(take) * DTypeSize(dtype);
    out += take;
    count -= take;
    begin = 0;
    if (count == 0) break;
  }
  LS_CHECK(count == 0, "a quantised weight's sources cover its elements");
  return bytes;
}

}  // namespace

LoadResult QuantizeSegments(const PackPlan& plan, const std::vector<ShmSegment*>& segments,
                            int threads, const std::function<bool()>& should_stop,
                            Progress* progress) {
  LoadResult result;
  for (const PackPlan::Literal& l : plan.literals) {
    const TensorSlice& t = PlanSegment(plan.manifest, l.block).tensors[l.slice];
    LS_CHECK(l.bytes.size() == t.nbytes, "a literal slice's size");
    std::memcpy(segments[l.block]->mutable_data() + t.offset, l.bytes.data(), t.nbytes);
  }
  if (plan.quantize.empty()) return result;
  const auto start = std::chrono::steady_clock::now();
  const Manifest& m = plan.manifest;
  auto slice = [&](size_t task, size_t offset) -> const TensorSlice& {
    const PackPlan::Quantize& q = plan.quantize[task];
    return PlanSegment(m, q.block).tensors[q.slice + offset];
  };
  auto at = [&](size_t task, size_t offset) {
    return segments[plan.quantize[task].block]->mutable_data() + slice(task, offset).offset;
  };
  std::vector<Piece> pieces;
  std::vector<std::vector<float>> absmax(plan.quantize.size());  // nf4: per block, f32
  for (size_t k = 0; k < plan.quantize.size(); ++k) {
    const TensorSlice& w = slice(k, 0);
    const int64_t rows = w.shape[0], numel = w.shape[0] * w.shape[1];
    if (w.quant.method == QuantMethod::kFp8) {
      for (int64_t r = 0; r < rows; r += w.quant.block_rows)
        pieces.push_back({k, r, std::min(rows, r + w.quant.block_rows)});
    } else {
      absmax[k].resize((numel + w.quant.blocksize - 1) / w.quant.blocksize);
      for (int64_t e = 0; e < numel; e += kNf4PieceElements)
        pieces.push_back({k, e, std::min(numel, e + kNf4PieceElements)});
    }
    for (const Checkpoint::Ref& src : plan.quantize[k].sources) result.bytes += src.entry->nbytes();
  }
  if (progress)
    progress->BeginPhase(std::string("quantising to ") + QuantMethodName(slice(0, 0).quant.method),
                         result.bytes);
  RunParallel(pieces.size(), threads, [&](size_t i) {
    if (should_stop && should_stop())
      throw Error(ErrorCode::kCancelled, "quantising interrupted by a signal");
    const Piece& p = pieces[i];
    const std::vector<Checkpoint::Ref>& sources = plan.quantize[p.task].sources;
    const TensorSlice& w = slice(p.task, 0);
    const int64_t cols = w.shape[1];
    std::vector<float> values;
    uint64_t read = 0;
    if (w.quant.method == QuantMethod::kFp8) {
      values.resize(static_cast<size_t>((p.end - p.begin) * cols));
      read = ReadElements(sources, p.begin * cols, (p.end - p.begin) * cols, values.data());
      const int64_t tiles = (cols + w.quant.block_cols - 1) / w.quant.block_cols;
      float* scales =
          reinterpret_cast<float*>(at(p.task, 1)) + p.begin / w.quant.block_rows * tiles;
      QuantizeFp8Band(values.data(), p.end - p.begin, cols, w.quant.block_cols,
                      at(p.task, 0) + p.begin * cols, scales);
    } else {
      values.resize(static_cast<size_t>(p.end - p.begin));
      read = ReadElements(sources, p.begin, p.end - p.begin, values.data());
      QuantizeNf4(values.data(), p.end - p.begin, w.quant.blocksize, at(p.task, 0) + p.begin / 2,
                  absmax[p.task].data() + p.begin / w.quant.blocksize);
    }
    if (progress) progress->Add(read);
  });
  // nf4's absmax, double-quantised around the mean of the whole weight's.
  RunParallel(plan.quantize.size(), threads, [&](size_t k) {
    const TensorSlice& w = slice(k, 0);
    if (w.quant.method != QuantMethod::kNf4) return;
    DoubleQuantizeAbsmax(absmax[k].data(), static_cast<int64_t>(absmax[k].size()),
                         w.quant.nested_blocksize, at(k, 1), reinterpret_cast<float*>(at(k, 2)),
                         reinterpret_cast<float*>(at(k, 5)));
    std::memcpy(at(k, 3), kNf4Code.data(), sizeof(float) * 16);
    std::memcpy(at(k, 4), DynamicMap8Bit().data(), sizeof(float) * 256);
  });
  if (progress) progress->EndPhase();
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

}  // namespace lorastream::store
