#include "store/dequantize.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <map>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/base/error.h"
#include "common/base/log.h"
#include "common/formats/flux_config.h"
#include "common/formats/safetensors.h"
#include "common/posix/durable_file.h"
#include "store/attach.h"
#include "store/parallel.h"
#include "store/quantize.h"
#include "store/server.h"

namespace lorastream::store {

namespace fs = std::filesystem;

namespace {

// Elements expanded per piece of work (even, so that nf4's byte pairs never split).
constexpr int64_t kPieceElements = int64_t{1} << 20;

std::string PrivateStoreName() {
  static std::atomic<int> counter{0};
  return "dequantize-" + std::to_string(::getpid()) + "-" + std::to_string(counter++);
}

int64_t Numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// The names of the scales of every compressed weight of `layout` (not written: the
// dequantised checkpoint is plain).
std::vector<std::string> AuxNames(const SegmentInfo& layout) {
  std::vector<std::string> names;
  for (const TensorSlice& t : layout.tensors)
    if (t.quant.compressed())
      for (const QuantAuxTensor& a : QuantAuxTensors(t.name, t.shape, t.quant))
        names.push_back(a.name);
  return names;
}

}  // namespace

void ExpandElements(const uint8_t* block, const SegmentInfo& layout, const TensorSlice& w,
                    int64_t begin, int64_t end, uint16_t* out) {
  auto aux = [&](const std::string& suffix) {
    const TensorSlice* s = layout.Find(w.name + suffix);
    LS_CHECK(s != nullptr, "compressed weight `" + w.name + "` without `" + suffix + "`");
    return block + s->offset;
  };
  auto f32 = [&](const std::string& suffix) { return reinterpret_cast<const float*>(aux(suffix)); };
  if (w.quant.method == QuantMethod::kFp8) {
    const Fp8Weight fw{block + w.offset, f32("_scale_inv"),  w.shape[0],
                       w.shape[1],       w.quant.block_rows, w.quant.block_cols};
    ExpandFp8(fw, begin, end, out);
    return;
  }
  LS_CHECK(w.quant.method == QuantMethod::kNf4, "unknown compressed format");
  const Nf4Weight nw{block + w.offset,  aux(".absmax"),           f32(".nested_absmax"),
                     f32(".quant_map"), f32(".nested_quant_map"), *f32(".nested_offset"),
                     Numel(w.shape),    w.quant.blocksize,        w.quant.nested_blocksize};
  ExpandNf4(nw, begin, end, out);
}

DequantizeResult WriteDequantized(const DequantizeOptions& options) {
  if (fs::exists(options.out_dir) && !fs::is_empty(options.out_dir))
    throw Error(ErrorCode::kInvalidArgument,
                options.out_dir + " already holds files; give a new or empty folder");
  const int threads = options.threads > 0
                          ? options.threads
                          : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  ServeOptions serve;
  serve.model_dir = options.model_dir;
  serve.name = PrivateStoreName();
  serve.threads = threads;
  serve.lock = false;  // read once and dropped
  serve.quantize = options.quantize;
  serve.quantize_head = options.quantize_head;
  serve.quantize_embedding = options.quantize_embedding;
  const std::unique_ptr<PublishedStore> published = PublishedStore::Build(serve);
  const AttachedStore store = AttachedStore::Attach(serve.name);
  const Manifest& m = store.manifest();
  DequantizeResult result;
  result.format = m.quant();
  if (!result.format.compressed())
    throw Error(ErrorCode::kInvalidArgument,
                options.model_dir +
                    " holds no compressed weights: give --quantize fp8|nf4 to dequantise what "
                    "that store would hold");

  // Every tensor in the checkpoint's own order: blocks, then the rest (whose LM head and
  // embedding may be compressed too). Expanded weights own their bytes; the others point
  // into the store's mapping.
  std::vector<TensorToWrite> tensors;
  std::vector<std::vector<uint16_t>> expanded;
  struct Job {
    const uint8_t* segment;
    const SegmentInfo* layout;
    const TensorSlice* slice;
    size_t index;  // into `expanded`
  };
  std::vector<Job> jobs;
  auto add_segment = [&](const uint8_t* data, const SegmentInfo& layout,
                         const std::string& prefix) {
    const std::vector<std::string> aux = AuxNames(layout);
    for (const TensorSlice& t : layout.tensors) {
      if (std::find(aux.begin(), aux.end(), t.name) != aux.end()) continue;
      if (!t.quant.compressed()) {
        tensors.push_back({prefix + t.name, t.dtype, t.shape, data + t.offset});
        continue;
      }
      jobs.push_back({data, &layout, &t, expanded.size()});
      expanded.emplace_back(static_cast<size_t>(Numel(t.shape)));
      tensors.push_back({prefix + t.name, DType::kBF16, t.shape, expanded.back().data()});
    }
  };
  for (int b = 0; b < store.num_blocks(); ++b)
    add_segment(store.block_data(b), m.blocks[b], m.block_prefix(b));
  add_segment(store.rest_data(), m.rest, "");

  std::vector<std::pair<size_t, int64_t>> pieces;  // (job, first element)
  for (size_t j = 0; j < jobs.size(); ++j)
    for (int64_t e = 0; e < Numel(jobs[j].slice->shape); e += kPieceElements)
      pieces.emplace_back(j, e);
  RunParallel(pieces.size(), threads, [&](size_t i) {
    const Job& job = jobs[pieces[i].first];
    const int64_t begin = pieces[i].second;
    const int64_t end = std::min(Numel(job.slice->shape), begin + kPieceElements);
    ExpandElements(job.segment, *job.layout, *job.slice, begin, end,
                   expanded[job.index].data() + begin);
  });
  result.expanded_tensors = static_cast<int>(jobs.size());

  fs::create_directories(options.out_dir);
  if (m.is_flux()) {  // BFL's single file, whichever layout the source was
    std::map<std::string, std::string> metadata = FluxMetadata(m.flux);
    metadata["format"] = "pt";
    WriteSafetensors((fs::path(options.out_dir) / "flux1.safetensors").string(), tensors, metadata);
    LS_LOG_INFO("dequantize: {} FLUX.1 linear weights of {} expanded to bf16 -> {}",
                result.expanded_tensors, DescribeQuant(result.format), options.out_dir);
    return result;
  }
  if (m.is_qwen_image()) {  // ComfyUI's single file, whichever form the source was
    std::map<std::string, std::string> metadata = QwenImageMetadata(m.qwen_image);
    metadata["format"] = "pt";
    WriteSafetensors((fs::path(options.out_dir) / "qwen_image_bf16.safetensors").string(), tensors,
                     metadata);
    LS_LOG_INFO("dequantize: {} Qwen-Image linear weights of {} expanded to bf16 -> {}",
                result.expanded_tensors, DescribeQuant(result.format), options.out_dir);
    return result;
  }
  WriteSafetensors((fs::path(options.out_dir) / "model.safetensors").string(), tensors,
                   {{"format", "pt"}});
  // config.json without its quantization_config; the other files as they are.
  for (const auto& entry : fs::directory_iterator(options.model_dir)) {
    const std::string file = entry.path().filename().string();
    if (!entry.is_regular_file() || entry.path().extension() == ".safetensors" ||
        file == "model.safetensors.index.json")
      continue;
    if (file == "config.json") {
      std::ifstream in(entry.path());
      nlohmann::json config = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
      if (config.is_discarded())
        throw Error(ErrorCode::kCorrupt, entry.path().string() + " is not valid JSON");
      config.erase("quantization_config");
      WriteFileDurably((fs::path(options.out_dir) / file).string(), config.dump(2) + "\n");
      continue;
    }
    fs::copy_file(entry.path(), fs::path(options.out_dir) / file);
  }
  LS_LOG_INFO("dequantize: {} weights of {} expanded to bf16 -> {}", result.expanded_tensors,
              DescribeQuant(result.format), options.out_dir);
  return result;
}

}  // namespace lorastream::store
