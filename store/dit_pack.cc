#include "store/dit_pack.h"

#include <optional>

#include "common/base/error.h"
#include "store/convert.h"

namespace lorastream::store {

DitPackPlan PlanDitPack(const std::string& path, const PackOptions& options,
                        DitCheckpoint checkpoint) {
  DitPackPlan plan;
  plan.reader = checkpoint.reader;
  auto fail = [&](const std::string& what) {
    throw Error(ErrorCode::kCorrupt, path + ": " + what);
  };

  // An fp8 checkpoint (flux1-dev-fp8, qwen_image_fp8_e4m3fn: its block linears' weights cast
  // to e4m3, without scales) is stored as it is, in the fp8 format with scales of 1 (exact:
  // every e4m3 value is a bf16 one).
  const bool fp8_checkpoint = [&] {
    for (const auto& [name, shape] : checkpoint.shapes)
      if (checkpoint.is_block_linear(name) &&
          checkpoint.pieces(name)[0].entry->dtype == DType::kF8E4M3)
        return true;
    return false;
  }();
  if (fp8_checkpoint && options.quantize == QuantMethod::kNf4)
    throw Error(ErrorCode::kUnsupported,
                path +
                    ": the checkpoint's linear weights are fp8 (F8_E4M3) already; serve it "
                    "without --quantize, or serve its bf16 original with --quantize nf4");
  // One dtype for the store: the checkpoint's (refused when mixed, unless converted).
  std::optional<DType> source_dtype;
  std::string first_tensor;
  for (const auto& [name, shape] : checkpoint.shapes)
    for (const SafetensorsRows& p : checkpoint.pieces(name)) {
      const DType dt = p.entry->dtype;
      if (fp8_checkpoint && checkpoint.is_block_linear(name)) {
        if (dt != DType::kF8E4M3)
          fail("tensor `" + p.entry->name + "` is " + DTypeName(dt) +
               " but the checkpoint's other block linear weights are F8_E4M3; an fp8 "
               "checkpoint holds every one of them in fp8");
        continue;
      }
      if (!ConvertibleToBF16(dt))
        fail("tensor `" + p.entry->name + "` is " + DTypeName(dt) +
             "; the store holds floating-point weights (F32, F16, BF16)");
      if (!source_dtype) {
        source_dtype = dt;
        first_tensor = p.entry->name;
      } else if (*source_dtype != dt && !options.to_bf16) {
        fail("tensor `" + p.entry->name + "` is " + DTypeName(dt) + " but `" + first_tensor +
             "` is " + DTypeName(*source_dtype) +
             "; serve with --dtype bf16 to convert all to BF16");
      }
    }
  const DType dtype = options.to_bf16 ? DType::kBF16 : *source_dtype;
  // With --quantize, every block linear's weight is stored compressed (LayoutSegment puts its
  // scales right after it); the loader computes them (QuantizeSegments) from its pieces.
  plan.layout = checkpoint.layout(
      dtype, StoreQuantFormat(fp8_checkpoint ? QuantMethod::kFp8 : options.quantize));
  const Manifest& layout = plan.layout;

  // A piece of a checkpoint tensor: its rows [source_row, source_row + rows) as an entry of
  // its own (same file), kept in plan.pieces.
  auto piece_source = [&](const SafetensorsRows& p) -> Checkpoint::Ref {
    SafetensorsEntry entry = *p.entry;
    const uint64_t source_row_bytes =
        entry.shape.empty() ? entry.nbytes() : entry.nbytes() / entry.shape[0];
    entry.begin += static_cast<uint64_t>(p.source_row) * source_row_bytes;
    entry.end = entry.begin + static_cast<uint64_t>(p.rows) * source_row_bytes;
    if (!entry.shape.empty()) entry.shape[0] = p.rows;
    plan.pieces.push_back(std::move(entry));
    return {p.file, &plan.pieces.back()};
  };
  // Each plain tensor's slice split by the runs of rows its pieces are, each with its piece as
  // source, and so an fp8 checkpoint's weight, whose scales of 1 are given; a weight to
  // quantise and its scales kept whole, computed by the loader.
  auto split = [&](size_t unit, const SegmentInfo& seg, std::vector<Checkpoint::Ref>& sources) {
    SegmentInfo out = seg;
    out.tensors.clear();
    size_t scales_left = 0;  // of the compressed weight before
    for (const TensorSlice& t : seg.tensors) {
      if (fp8_checkpoint && scales_left > 0) {  // its scale_inv: 1 for every tile
        const std::vector<float> ones(t.nbytes / sizeof(float), 1.0f);
        const auto* bytes = reinterpret_cast<const uint8_t*>(ones.data());
        plan.load.literals.push_back({unit, out.tensors.size(), {bytes, bytes + t.nbytes}});
        --scales_left;
        out.tensors.push_back(t);
        sources.push_back({nullptr, nullptr});
        continue;
      }
      if (fp8_checkpoint && t.quant.compressed())
        scales_left = QuantAuxTensors(t.name, t.shape, t.quant).size();
      if (!fp8_checkpoint && (t.quant.compressed() || scales_left > 0)) {
        if (t.quant.compressed()) {
          PackPlan::Quantize q{unit, out.tensors.size(), {}};
          for (const SafetensorsRows& p : checkpoint.pieces(t.name))
            q.sources.push_back(piece_source(p));
          plan.load.quantize.push_back(std::move(q));
          scales_left = QuantAuxTensors(t.name, t.shape, t.quant).size();
        } else {
          --scales_left;
        }
        out.tensors.push_back(t);
        sources.push_back({nullptr, nullptr});
        continue;
      }
      const uint64_t row_bytes = t.shape.empty() ? t.nbytes : t.nbytes / t.shape[0];
      for (const SafetensorsRows& p : checkpoint.pieces(t.name)) {
        sources.push_back(piece_source(p));
        TensorSlice piece = t;
        piece.offset = t.offset + static_cast<uint64_t>(p.row) * row_bytes;
        piece.nbytes = static_cast<uint64_t>(p.rows) * row_bytes;
        piece.shape = sources.back().entry->shape;
        out.tensors.push_back(std::move(piece));
      }
    }
    return out;
  };
  Manifest& m = plan.load.manifest;
  m = layout;
  m.source_dir = path;
  plan.load.block_sources.resize(layout.blocks.size());
  for (size_t u = 0; u < layout.blocks.size(); ++u)
    m.blocks[u] = split(u, layout.blocks[u], plan.load.block_sources[u]);
  m.rest = split(0, layout.rest, plan.load.rest_sources);
  if (options.scan_weights) RefuseNonFiniteWeights(plan.load);
  return plan;
}

DitPackPlan PlanFluxPack(const std::string& path, const PackOptions& options,
                         int64_t singles_per_unit) {
  auto reader = std::make_shared<const FluxCheckpointReader>(FluxCheckpointReader::Open(path));
  DitCheckpoint c;
  c.reader = reader;
  c.shapes = FluxAllShapes(reader->config());
  c.pieces = [r = reader.get()](const std::string& name) { return r->Pieces(name); };
  c.is_block_linear = IsFluxBlockLinearWeight;
  c.layout = [&, r = reader.get()](DType dtype, const QuantInfo& linears) {
    return FluxManifest(r->config(), singles_per_unit, dtype, options.alignment, linears);
  };
  return PlanDitPack(path, options, std::move(c));
}

DitPackPlan PlanQwenImagePack(const std::string& path, const PackOptions& options) {
  auto reader =
      std::make_shared<const QwenImageCheckpointReader>(QwenImageCheckpointReader::Open(path));
  DitCheckpoint c;
  c.reader = reader;
  c.shapes = QwenImageAllShapes(reader->config());
  c.pieces = [r = reader.get()](const std::string& name) {
    const SafetensorsFolder::Ref ref = r->Get(name);
    const int64_t rows = ref.entry->shape.empty() ? 1 : ref.entry->shape[0];
    return std::vector<SafetensorsRows>{{ref.file, ref.entry, 0, 0, rows}};
  };
  c.is_block_linear = IsQwenImageBlockLinearWeight;
  c.layout = [&, r = reader.get()](DType dtype, const QuantInfo& linears) {
    return QwenImageManifest(r->config(), dtype, options.alignment, linears);
  };
  return PlanDitPack(path, options, std::move(c));
}

Manifest DitPublishedManifest(const DitPackPlan& plan) {
  Manifest m = plan.load.manifest;
  auto place = [](SegmentInfo& out, const SegmentInfo& tensors) {
    LS_CHECK(out.nbytes == tensors.nbytes, "a segment's pieces cover its layout");
    out.tensors = tensors.tensors;
  };
  for (size_t u = 0; u < m.blocks.size(); ++u) place(m.blocks[u], plan.layout.blocks[u]);
  place(m.rest, plan.layout.rest);
  return m;
}

}  // namespace lorastream::store
