// Manifest <-> JSON. The reader validates the layout so that an attacher can trust every
// offset it hands out as a pointer.
#include "common/formats/manifest.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <functional>
#include <optional>

#include <nlohmann/json.hpp>

#include "common/base/error.h"
#include "common/formats/flux_layout.h"
#include "common/formats/qwen_image_layout.h"

namespace lorastream {

namespace {

using Json = nlohmann::json;

std::string Hex(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "%016" PRIx64, v);
  return buf;
}

[[noreturn]] void Bad(const std::string& source, const std::string& what) {
  throw Error(ErrorCode::kCorrupt, source + ": manifest " + what);
}

// `where` by value: a reference parameter bound to a temporary string would make GCC 13 take
// the returned reference (into `j`) for a dangling one.
const Json& Field(const Json& j, const char* key, const std::string& source, std::string where) {
  auto it = j.find(key);
  if (it == j.end()) Bad(source, where + "`" + key + "` is missing");
  return *it;
}

std::string GetString(const Json& j, const char* key, const std::string& source,
                      const std::string& where = "") {
  const Json& v = Field(j, key, source, where);
  if (!v.is_string()) Bad(source, where + "`" + key + "` must be a string");
  return v.get<std::string>();
}

uint64_t GetUnsigned(const Json& j, const char* key, const std::string& source,
                     const std::string& where = "") {
  const Json& v = Field(j, key, source, where);
  if (!v.is_number_unsigned()) Bad(source, where + "`" + key + "` must be a non-negative integer");
  return v.get<uint64_t>();
}

uint64_t GetHex(const Json& j, const char* key, const std::string& source,
                const std::string& where = "") {
  std::string s = GetString(j, key, source, where);
  if (s.empty() || s.size() > 16 || s.find_first_not_of("0123456789abcdef") != std::string::npos)
    Bad(source, where + "`" + key + "` must be a hex string of at most 16 digits");
  return std::stoull(s, nullptr, 16);
}

DType GetDType(const Json& j, const char* key, const std::string& source,
               const std::string& where = "") {
  auto d = ParseDType(GetString(j, key, source, where));
  if (!d) Bad(source, where + "`" + key + "` is not a known dtype");
  return *d;
}

Json SegmentToJson(const SegmentInfo& s) {
  Json tensors = Json::array();
  for (const TensorSlice& t : s.tensors) {
    Json tensor = {{"name", t.name},
                   {"dtype", DTypeName(t.dtype)},
                   {"shape", t.shape},
                   {"offset", t.offset},
                   {"nbytes", t.nbytes}};
    // Absent for a plain tensor: manifests from before compression read the same.
    if (t.quant.method == QuantMethod::kFp8)
      tensor["quant"] = {{"method", "fp8"}, {"block", {t.quant.block_rows, t.quant.block_cols}}};
    if (t.quant.method == QuantMethod::kNf4)
      tensor["quant"] = {{"method", "nf4"},
                         {"blocksize", t.quant.blocksize},
                         {"nested_blocksize", t.quant.nested_blocksize}};
    tensors.push_back(std::move(tensor));
  }
  return {{"shm_name", s.shm_name},
          {"nbytes", s.nbytes},
          {"checksum", Hex(s.checksum)},
          {"tensors", tensors}};
}

QuantInfo QuantFromJson(const Json& j, const std::string& source, const std::string& at) {
  if (!j.is_object()) Bad(source, at + "`quant` must be an object");
  QuantInfo q;
  const std::string method = GetString(j, "method", source, at + "quant: ");
  const std::optional<QuantMethod> m = ParseQuantMethod(method);
  if (!m || *m == QuantMethod::kNone)
    Bad(source, at + "`quant.method` `" + method + "` is not a known format (fp8, nf4)");
  q.method = *m;
  auto positive = [&](const Json& v, const char* what) {
    if (!v.is_number_unsigned() || v.get<uint64_t>() == 0 || v.get<uint64_t>() > (1u << 20))
      Bad(source, at + "`quant." + what + "` must be a positive integer");
    return v.get<int64_t>();
  };
  if (q.method == QuantMethod::kFp8) {
    const Json& block = Field(j, "block", source, at + "quant: ");
    if (!block.is_array() || block.size() != 2)
      Bad(source, at + "`quant.block` must be [rows, cols]");
    q.block_rows = positive(block[0], "block");
    q.block_cols = positive(block[1], "block");
  } else {
    q.blocksize = positive(Field(j, "blocksize", source, at + "quant: "), "blocksize");
    q.nested_blocksize =
        positive(Field(j, "nested_blocksize", source, at + "quant: "), "nested_blocksize");
  }
  return q;
}

SegmentInfo SegmentFromJson(const Json& j, uint64_t alignment, const std::string& source,
                            const std::string& where, bool rest_segment = false) {
  if (!j.is_object()) Bad(source, where + "is not an object");
  SegmentInfo s;
  s.shm_name = GetString(j, "shm_name", source, where);
  if (s.shm_name.size() < 2 || s.shm_name[0] != '/' || s.shm_name.find('/', 1) != std::string::npos)
    Bad(source, where + "`shm_name` must be `/name` without further slashes");
  s.nbytes = GetUnsigned(j, "nbytes", source, where);
  s.checksum = GetHex(j, "checksum", source, where);
  const Json& tensors = Field(j, "tensors", source, where);
  if (!tensors.is_array()) Bad(source, where + "`tensors` must be an array");
  for (const Json& t : tensors) {
    if (!t.is_object()) Bad(source, where + "tensor entry is not an object");
    TensorSlice slice;
    slice.name = GetString(t, "name", source, where);
    const std::string at = where + "tensor `" + slice.name + "`: ";
    slice.dtype = GetDType(t, "dtype", source, at);
    slice.offset = GetUnsigned(t, "offset", source, at);
    slice.nbytes = GetUnsigned(t, "nbytes", source, at);
    const Json& shape = Field(t, "shape", source, at);
    if (!shape.is_array()) Bad(source, at + "`shape` must be an array");
    uint64_t numel = 1;
    for (const Json& d : shape) {
      if (!d.is_number_unsigned() || d.get<uint64_t>() > (uint64_t{1} << 40))
        Bad(source, at + "`shape` must hold non-negative integers");
      slice.shape.push_back(d.get<int64_t>());
      numel *= d.get<uint64_t>();
      if (numel > (uint64_t{1} << 48)) Bad(source, at + "`shape` is too large");
    }
    if (t.contains("quant")) slice.quant = QuantFromJson(t["quant"], source, at);
    const uint64_t want = slice.quant.compressed() ? QuantizedWeightBytes(slice.shape, slice.quant)
                                                   : numel * DTypeSize(slice.dtype);
    if (want != slice.nbytes) Bad(source, at + "`nbytes` does not match its shape and dtype");
    if (slice.offset % alignment != 0) Bad(source, at + "`offset` is not aligned");
    if (slice.offset > s.nbytes || slice.nbytes > s.nbytes - slice.offset)
      Bad(source, at + "lies outside its segment");
    s.tensors.push_back(std::move(slice));
  }
  const std::string problem = QuantLayoutProblem(s, rest_segment);
  if (!problem.empty()) Bad(source, where + problem);
  return s;
}

}  // namespace

namespace {

SegmentInfo LayoutCompressing(
    const std::vector<std::pair<std::string, std::vector<int64_t>>>& shapes,
    const std::string& shm_name, DType dtype, uint64_t alignment, const QuantInfo& format,
    const std::function<bool(const std::string&)>& compressed) {
  if (alignment == 0 || (alignment & (alignment - 1)) != 0)
    throw Error(ErrorCode::kInvalidArgument, "alignment must be a power of two");
  SegmentInfo s;
  s.shm_name = shm_name;
  auto place = [&](TensorSlice t) {
    t.offset = (s.nbytes + alignment - 1) / alignment * alignment;
    s.nbytes = t.offset + t.nbytes;
    s.tensors.push_back(std::move(t));
  };
  auto plain = [&](const std::string& name, DType type, const std::vector<int64_t>& shape) {
    TensorSlice t;
    t.name = name;
    t.dtype = type;
    t.shape = shape;
    t.nbytes = DTypeSize(type);
    for (int64_t d : shape) t.nbytes *= static_cast<uint64_t>(d);
    return t;
  };
  for (const auto& [name, shape] : shapes) {
    if (!format.compressed() || !compressed(name)) {
      place(plain(name, dtype, shape));
      continue;
    }
    TensorSlice w = plain(name, QuantizedWeightDType(format), shape);
    w.quant = format;
    w.nbytes = QuantizedWeightBytes(shape, format);
    place(std::move(w));
    for (const QuantAuxTensor& aux : QuantAuxTensors(name, shape, format))
      place(plain(aux.name, aux.dtype, aux.shape));
  }
  return s;
}

}  // namespace

SegmentInfo LayoutSegment(const std::vector<std::pair<std::string, std::vector<int64_t>>>& shapes,
                          const std::string& shm_name, DType dtype, uint64_t alignment,
                          const QuantInfo& projections) {
  return LayoutCompressing(shapes, shm_name, dtype, alignment, projections, IsProjectionWeight);
}

SegmentInfo LayoutSegment(const std::vector<std::pair<std::string, std::vector<int64_t>>>& shapes,
                          const std::string& shm_name, DType dtype, uint64_t alignment,
                          const QuantInfo& format, const std::vector<std::string>& compressed) {
  return LayoutCompressing(
      shapes, shm_name, dtype, alignment, format, [&](const std::string& name) {
        return std::find(compressed.begin(), compressed.end(), name) != compressed.end();
      });
}

const TensorSlice* SegmentInfo::Find(const std::string& name) const {
  for (const TensorSlice& t : tensors)
    if (t.name == name) return &t;
  return nullptr;
}

uint64_t Manifest::total_bytes() const {
  uint64_t total = rest.nbytes;
  for (const SegmentInfo& b : blocks) total += b.nbytes;
  return total;
}

const TensorSlice* Manifest::head() const {
  if (is_diffusion()) return nullptr;
  return rest.Find(config.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight");
}

std::string Manifest::family() const {
  const ModelFamily f = model_family();
  return f == ModelFamily::kLlm ? "LLM (" + config.model_type + ")" : ModelFamilyName(f);
}

std::string Manifest::block_prefix(size_t i) const {
  return is_diffusion() ? "" : "model.layers." + std::to_string(i) + ".";
}

std::string ManifestShapeJson(const Manifest& m) {
  Json shape;
  if (m.is_flux())
    FluxManifestToJson(shape, m);
  else if (m.is_qwen_image())
    shape = Json::parse(QwenImageConfigJson(m.qwen_image));
  else
    ToJson(shape, m.config);
  return shape.dump();
}

namespace {

bool SameSlices(const SegmentInfo& a, const SegmentInfo& b) {
  if (a.nbytes != b.nbytes || a.tensors.size() != b.tensors.size()) return false;
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    const TensorSlice &x = a.tensors[i], &y = b.tensors[i];
    if (x.name != y.name || x.dtype != y.dtype || x.shape != y.shape || x.offset != y.offset ||
        x.nbytes != y.nbytes || !(x.quant == y.quant))
      return false;
  }
  return true;
}

}  // namespace

void RequireManifestLayout(const Manifest& m, const Manifest& want, const std::string& source,
                           const std::string& unit) {
  const std::string family = m.family();
  const std::string layout =
      " is not the " + (m.is_flux() ? std::string("FLUX") : family) + " layout of its shape";
  if (m.blocks.size() != want.blocks.size())
    Bad(source, "has " + std::to_string(m.blocks.size()) + " " + family + " " + unit +
                    "s but its shape has " + std::to_string(want.blocks.size()));
  for (size_t u = 0; u < m.blocks.size(); ++u)
    if (!SameSlices(m.blocks[u], want.blocks[u]))
      Bad(source, unit + " " + std::to_string(u) + layout);
  if (!SameSlices(m.rest, want.rest)) Bad(source, "rest" + layout);
}

std::string Manifest::DescribeCompression() const {
  std::string text = quant().compressed() ? ", blocks " + DescribeQuant(quant()) : "";
  for (const TensorSlice& t : rest.tensors) {
    if (!t.quant.compressed()) continue;
    const bool embedding = t.name == "model.embed_tokens.weight";
    text += std::string(", ") +
            (embedding ? (config.tie_word_embeddings ? "LM head and embedding" : "embedding")
                       : "LM head") +
            " " + QuantMethodName(t.quant.method);
  }
  return text;
}

QuantInfo Manifest::quant() const {
  return blocks.empty() ? QuantInfo{} : SegmentQuant(blocks.front());
}

std::string ManifestToJson(const Manifest& m) {
  Json config;
  if (m.is_diffusion())
    config = {{"model_type", m.config.model_type}};  // its shape is under "flux"/"qwen_image"
  else
    ToJson(config, m.config);
  Json blocks = Json::array();
  for (const SegmentInfo& b : m.blocks) blocks.push_back(SegmentToJson(b));
  Json j = {{"format", "lorastream-manifest-1"},
            {"store_name", m.store_name},
            {"generation", Hex(m.generation)},
            {"fingerprint", m.fingerprint},
            {"config", config},
            {"dtype", DTypeName(m.dtype)},
            {"alignment", m.alignment},
            {"blocks", blocks},
            {"rest", SegmentToJson(m.rest)},
            {"owner_pid", m.owner_pid},
            {"owner_start_time", m.owner_start_time},
            {"source_dir", m.source_dir}};
  if (m.is_flux()) FluxManifestToJson(j["flux"], m);
  if (m.is_qwen_image()) j["qwen_image"] = Json::parse(QwenImageConfigJson(m.qwen_image));
  if (!m.tokenizer.fingerprint.empty())
    j["tokenizer"] = {{"name", m.tokenizer.name},
                      {"fingerprint", m.tokenizer.fingerprint},
                      {"vocab_size", m.tokenizer.vocab_size}};
  return j.dump(1);
}

Manifest ManifestFromJson(const std::string& text, const std::string& source) {
  Json j = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) Bad(source, "is not valid JSON");
  if (!j.is_object()) Bad(source, "is not a JSON object");
  if (GetString(j, "format", source) != "lorastream-manifest-1")
    Bad(source, "has an unknown `format` (expected lorastream-manifest-1)");
  Manifest m;
  m.store_name = GetString(j, "store_name", source);
  m.generation = GetHex(j, "generation", source);
  m.fingerprint = GetString(j, "fingerprint", source);
  const Json& config = Field(j, "config", source, "");
  const Json model_type = config.is_object() ? config.value("model_type", Json()) : Json();
  if (model_type == kFluxModelType)
    FluxManifestFromJson(Field(j, "flux", source, ""), m, source);  // sets config too
  else if (model_type == kQwenImageModelType)
    QwenImageManifestFromJson(Field(j, "qwen_image", source, ""), m, source);  // and config
  else
    m.config = ModelConfigFromJson(config, source + " (config)");
  m.dtype = GetDType(j, "dtype", source);
  m.alignment = GetUnsigned(j, "alignment", source);
  if (m.alignment == 0 || (m.alignment & (m.alignment - 1)) != 0)
    Bad(source, "`alignment` must be a power of two");
  const std::string top;  // a named "where" for top-level fields (no temporary behind a reference)
  const Json& blocks = Field(j, "blocks", source, top);
  if (!blocks.is_array()) Bad(source, "`blocks` must be an array");
  for (size_t i = 0; i < blocks.size(); ++i)
    m.blocks.push_back(
        SegmentFromJson(blocks[i], m.alignment, source, "block " + std::to_string(i) + ": "));
  if (static_cast<int64_t>(m.blocks.size()) != m.config.num_hidden_layers)
    Bad(source, "has " + std::to_string(m.blocks.size()) + " blocks but the config has " +
                    std::to_string(m.config.num_hidden_layers) + " layers");
  m.rest = SegmentFromJson(Field(j, "rest", source, ""), m.alignment, source, "rest: ",
                           /*rest_segment=*/true);
  if (m.is_flux())
    RequireManifestLayout(
        m, FluxManifest(m.flux, m.flux_singles_per_unit, m.dtype, m.alignment, m.quant()), source,
        "unit");
  if (m.is_qwen_image())
    RequireManifestLayout(m, QwenImageManifest(m.qwen_image, m.dtype, m.alignment, m.quant()),
                          source, "block");
  const Json& pid = Field(j, "owner_pid", source, top);
  if (!pid.is_number_integer()) Bad(source, "`owner_pid` must be an integer");
  m.owner_pid = pid.get<int64_t>();
  m.owner_start_time = GetUnsigned(j, "owner_start_time", source);
  m.source_dir = GetString(j, "source_dir", source);
  if (j.contains("tokenizer")) {  // absent in manifests of folders without tokenizer.json
    const Json& t = j["tokenizer"];
    m.tokenizer.name = GetString(t, "name", source, "tokenizer: ");
    m.tokenizer.fingerprint = GetString(t, "fingerprint", source, "tokenizer: ");
    const Json& v = Field(t, "vocab_size", source, "tokenizer: ");
    if (!v.is_number_integer()) Bad(source, "`tokenizer.vocab_size` must be an integer");
    m.tokenizer.vocab_size = v.get<int64_t>();
  }
  return m;
}

}  // namespace lorastream
