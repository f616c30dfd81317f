#include "store/synth.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "common/base/device.h"
#include "common/base/error.h"
#include "common/formats/safetensors.h"
#include "common/formats/tokenizer_id.h"
#include "common/formats/toml_file.h"
#include "common/posix/install_paths.h"
#include "store/checksum.h"
#include "store/convert.h"
#include "store/quantize.h"
#include "store/synth_flux.h"
#include "store/synth_qwen_image.h"

namespace lorastream::store {

namespace {

inline uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Sum of four 16-bit uniforms (Irwin-Hall): close to a standard normal, cheap, no tails.
inline float NormalIsh(uint64_t bits) {
  const uint32_t sum = static_cast<uint32_t>((bits & 0xffff) + ((bits >> 16) & 0xffff) +
                                             ((bits >> 32) & 0xffff) + (bits >> 48));
  return (static_cast<float>(sum) - 131070.0f) * (1.0f / 37837.2f);
}

// HF-like init: matrices N(0, 0.02); norm weights 1 + N(0, 0.02) (not exactly 1, so that a
// mixed-up norm weight shows in parity tests); biases N(0, 0.01).
struct Scale {
  float mean, std;
};
Scale ScaleFor(const std::string& name, size_t rank) {
  if (name.find("norm") != std::string::npos) return {1.0f, 0.02f};
  if (name.size() >= 5 && name.compare(name.size() - 5, 5, ".bias") == 0) return {0.0f, 0.01f};
  return {0.0f, rank >= 2 ? 0.02f : 0.01f};
}

uint64_t TensorKey(const std::string& name, uint64_t seed) {
  return Xxh64(name.data(), name.size(), seed);
}

DType ParseSynthDType(const std::string& s, const std::string& where) {
  if (const std::optional<DType> d = ParseShortDType(s)) return *d;
  throw Error(ErrorCode::kInvalidArgument, where + ": dtype `" + s + "` must be f32, f16 or bf16");
}

const char* TorchDTypeName(DType d) {
  return d == DType::kF32 ? "float32" : d == DType::kF16 ? "float16" : "bfloat16";
}

void WriteTextFile(const std::string& path, const std::string& text) {
  const std::string temp = path + ".tmp";
  {
    std::ofstream out(temp, std::ios::binary | std::ios::trunc);
    out << text;
    if (!out) throw Error(ErrorCode::kIo, temp + ": write failed");
  }
  if (::rename(temp.c_str(), path.c_str()) != 0) ThrowErrno(path + ": rename failed");
}

// A folder that holds anything is refused: synth would replace or mix with what is there (a
// user's checkpoint shards, say) without a word. --force replaces the checkpoint files.
void RefuseNonEmpty(const std::string& dir) {
  std::error_code ec;
  std::filesystem::directory_iterator it(dir, ec);
  if (ec || it == std::filesystem::directory_iterator()) return;  // missing or empty
  throw Error(ErrorCode::kInvalidArgument,
              "--out " + dir + " is not empty (it holds " + it->path().filename().string() +
                  "): choose a new or empty folder, or pass --force to replace its checkpoint "
                  "files");
}

// `from` copied to `to` under a temporary name, renamed once complete.
void CopyFileThroughTemp(const std::filesystem::path& from, const std::filesystem::path& to) {
  std::ifstream in(from, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw Error(ErrorCode::kIo, from.string() + ": read failed");
  WriteTextFile(to.string(), bytes);
}

// Removes the checkpoint files of an earlier run so that a stale index never survives.
void RemoveOldCheckpoint(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (!d) return;
  while (dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name.compare(0, 5, "model") == 0 && name.find(".safetensors") != std::string::npos)
      ::unlink((dir + "/" + name).c_str());
  }
  ::closedir(d);
}

}  // namespace

float SynthValue(const std::string& name, size_t rank, uint64_t seed, uint64_t index) {
  const Scale s = ScaleFor(name, rank);
  return s.mean + s.std * NormalIsh(SplitMix64(TensorKey(name, seed) + index));
}

void SynthFill(const std::string& name, size_t rank, uint64_t seed, uint64_t first, uint64_t count,
               DType dtype, uint8_t* out, int threads) {
  const Scale scale = ScaleFor(name, rank);
  const uint64_t key = TensorKey(name, seed);
  auto work = [=](uint64_t begin, uint64_t end) {
    // Locals and typed pointers: writes through uint8_t* would alias everything.
    const float mean = scale.mean, std = scale.std;
    if (dtype == DType::kF32) {
      float* o = reinterpret_cast<float*>(out);
      for (uint64_t i = begin; i < end; ++i)
        o[i] = mean + std * NormalIsh(SplitMix64(key + first + i));
    } else if (dtype == DType::kBF16) {
      uint16_t* o = reinterpret_cast<uint16_t*>(out);
      for (uint64_t i = begin; i < end; ++i)
        o[i] = FloatToBF16(mean + std * NormalIsh(SplitMix64(key + first + i)));
    } else {
      uint16_t* o = reinterpret_cast<uint16_t*>(out);
      for (uint64_t i = begin; i < end; ++i)
        o[i] = FloatToHalf(mean + std * NormalIsh(SplitMix64(key + first + i)));
    }
  };
  const int parts = count < (1u << 16) ? 1 : std::max(1, threads);
  std::vector<std::thread> pool;
  for (int p = 1; p < parts; ++p)
    pool.emplace_back(work, count * p / parts, count * (p + 1) / parts);
  work(0, count / parts);
  for (std::thread& th : pool) th.join();
}

std::string DefaultPresetsDir() {
  const char* env = std::getenv("LORASTREAM_PRESETS_DIR");
  return env && *env ? std::string(env) : ConfigsDir() + "/models";
}

Preset LoadPreset(const std::string& name_or_path, const std::string& presets_dir) {
  const bool is_path =
      name_or_path.find('/') != std::string::npos ||
      (name_or_path.size() > 5 && name_or_path.compare(name_or_path.size() - 5, 5, ".toml") == 0);
  const std::string path = is_path ? name_or_path : presets_dir + "/" + name_or_path + ".toml";
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0)
    throw Error(ErrorCode::kNotFound, "preset `" + name_or_path + "`: " + path +
                                          " does not exist (presets live in " + presets_dir + ")");
  TomlSection t = TomlSection::Load(path);
  t.RejectUnknownKeys({"model_type",
                       "hidden_size",
                       "intermediate_size",
                       "num_hidden_layers",
                       "num_attention_heads",
                       "num_key_value_heads",
                       "head_dim",
                       "vocab_size",
                       "max_position_embeddings",
                       "rope_theta",
                       "rms_norm_eps",
                       "tie_word_embeddings",
                       "attention_bias",
                       "dtype",
                       "rope_scaling",
                       "num_experts",
                       "num_local_experts",
                       "num_experts_per_tok",
                       "moe_intermediate_size",
                       "norm_topk_prob"});
  nlohmann::json j = {
      {"model_type", t.RequireString("model_type")},
      {"hidden_size", t.RequireInt("hidden_size")},
      {"intermediate_size", t.RequireInt("intermediate_size")},
      {"num_hidden_layers", t.RequireInt("num_hidden_layers")},
      {"num_attention_heads", t.RequireInt("num_attention_heads")},
      {"num_key_value_heads", t.GetInt("num_key_value_heads", t.RequireInt("num_attention_heads"))},
      {"vocab_size", t.RequireInt("vocab_size")},
      {"max_position_embeddings", t.GetInt("max_position_embeddings", 2048)},
      {"rope_theta", t.GetDouble("rope_theta", 10000.0)},
      {"rms_norm_eps", t.GetDouble("rms_norm_eps", 1e-6)},
      {"tie_word_embeddings", t.GetBool("tie_word_embeddings", false)},
      {"attention_bias", t.GetBool("attention_bias", false)}};
  if (t.Has("head_dim")) j["head_dim"] = t.RequireInt("head_dim");
  // A mixture of experts (qwen3_moe, mixtral): config.json's own keys.
  for (const char* key :
       {"num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size"})
    if (t.Has(key)) j[key] = t.RequireInt(key);
  if (t.Has("norm_topk_prob")) j["norm_topk_prob"] = t.GetBool("norm_topk_prob", false);
  if (t.Has("rope_scaling")) {
    TomlSection rs = t.Section("rope_scaling");
    rs.RejectUnknownKeys({"rope_type", "factor", "low_freq_factor", "high_freq_factor",
                          "original_max_position_embeddings"});
    j["rope_scaling"] = {
        {"rope_type", rs.RequireString("rope_type")},
        {"factor", rs.GetDouble("factor", 1.0)},
        {"low_freq_factor", rs.GetDouble("low_freq_factor", 1.0)},
        {"high_freq_factor", rs.GetDouble("high_freq_factor", 4.0)},
        {"original_max_position_embeddings", rs.GetInt("original_max_position_embeddings", 8192)}};
  }
  Preset preset;
  preset.config = ModelConfigFromJson(j, path);
  preset.dtype = ParseSynthDType(t.GetString("dtype", "f32"), t.Where("dtype"));
  return preset;
}

SynthResult RunSynth(const SynthOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  if (options.out_dir.empty()) throw Error(ErrorCode::kInvalidArgument, "--out is required");
  const std::string preset_path = PresetPath(
      options.preset, options.presets_dir.empty() ? DefaultPresetsDir() : options.presets_dir);
  if (IsFluxPreset(preset_path)) return RunSynthFlux(options, preset_path);
  if (IsQwenImagePreset(preset_path)) return RunSynthQwenImage(options, preset_path);
  Preset preset = LoadPreset(
      options.preset, options.presets_dir.empty() ? DefaultPresetsDir() : options.presets_dir);
  ModelConfig config = preset.config;
  if (options.layers < 0) throw Error(ErrorCode::kInvalidArgument, "--layers must be positive");
  if (options.layers > 0) config.num_hidden_layers = options.layers;
  const DType dtype =
      options.dtype.empty() ? preset.dtype : ParseSynthDType(options.dtype, "--dtype");
  config.torch_dtype = TorchDTypeName(dtype);
  // --tokenizer: a folder, or the name of a tokenizer bundled with lorastream ("llama3").
  std::string tokenizer_dir = options.tokenizer_dir;
  std::error_code ec;
  if (!tokenizer_dir.empty() && !std::filesystem::exists(tokenizer_dir, ec)) {
    const std::string bundled = BundledTokenizerDir(tokenizer_dir);
    if (bundled.empty())
      throw Error(ErrorCode::kNotFound,
                  "--tokenizer " + tokenizer_dir +
                      " does not exist: name a Hugging Face tokenizer folder (tokenizer.json, "
                      "tokenizer_config.json), or a tokenizer bundled with lorastream (llama3)");
    tokenizer_dir = bundled;
  }
  if (!tokenizer_dir.empty()) {  // a model that `lorastream prepare` can make data for
    std::optional<TokenizerId> tokenizer = ModelTokenizerId(tokenizer_dir);
    if (!tokenizer)
      throw Error(ErrorCode::kNotFound,
                  "--tokenizer " + tokenizer_dir +
                      " has no tokenizer.json (a Hugging Face tokenizer folder)");
    config.vocab_size = std::max(config.vocab_size, tokenizer->vocab_size);
  }
  const int threads = options.threads > 0
                          ? options.threads
                          : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));

  // Tensors in HF's order: embeddings, blocks, final norm, lm_head.
  std::vector<TensorToWrite> tensors;
  auto rest = config.RestTensorShapes();
  tensors.push_back({rest[0].first, dtype, rest[0].second, nullptr});
  for (int64_t i = 0; i < config.num_hidden_layers; ++i)
    for (const auto& [rel, shape] : config.BlockTensorShapes())
      tensors.push_back({"model.layers." + std::to_string(i) + "." + rel, dtype, shape, nullptr});
  for (size_t k = 1; k < rest.size(); ++k)
    tensors.push_back({rest[k].first, dtype, rest[k].second, nullptr});

  std::vector<std::vector<TensorToWrite>> shards(1);
  uint64_t shard_size = 0, total = 0;
  for (const TensorToWrite& t : tensors) {
    const uint64_t n = TensorBytes(t);
    if (shard_size > 0 && shard_size + n > options.shard_bytes) {
      shards.emplace_back();
      shard_size = 0;
    }
    shards.back().push_back(t);
    shard_size += n;
    total += n;
  }

  if (!options.force) RefuseNonEmpty(options.out_dir);
  for (size_t pos = 1; pos != std::string::npos;) {  // mkdir -p
    pos = options.out_dir.find('/', pos + 1);
    const std::string part = options.out_dir.substr(0, pos);
    if (::mkdir(part.c_str(), 0755) != 0 && errno != EEXIST) ThrowErrno(part + ": cannot create");
  }
  RemoveOldCheckpoint(options.out_dir);
  const size_t esize = DTypeSize(dtype);
  nlohmann::json weight_map = nlohmann::json::object();
  for (size_t s = 0; s < shards.size(); ++s) {
    char file[64];
    std::snprintf(file, sizeof(file), "model-%05zu-of-%05zu.safetensors", s + 1, shards.size());
    const std::string name = shards.size() == 1 ? "model.safetensors" : file;
    const auto& list = shards[s];
    auto fill = [&](size_t index, uint64_t offset, uint8_t* out, size_t n) {
      const TensorToWrite& t = list[index];
      SynthFill(t.name, t.shape.size(), options.seed, offset / esize, n / esize, dtype, out,
                threads);
    };
    WriteSafetensorsStreamed(options.out_dir + "/" + name, list, fill, {{"format", "pt"}}, 64);
    for (const TensorToWrite& t : list) weight_map[t.name] = name;
  }
  if (shards.size() > 1) {
    nlohmann::json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    WriteTextFile(options.out_dir + "/model.safetensors.index.json", index.dump(2));
  }
  nlohmann::json cj;
  ToJson(cj, config);
  WriteTextFile(options.out_dir + "/config.json", cj.dump(2));
  if (!tokenizer_dir.empty())
    for (const char* name : {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                             "special_tokens_map.json"}) {
      const std::filesystem::path from = std::filesystem::path(tokenizer_dir) / name;
      if (std::filesystem::exists(from))
        CopyFileThroughTemp(from, std::filesystem::path(options.out_dir) / name);
    }
  if (!options.prequantized.empty()) WritePrequantized(options.out_dir, options.prequantized);
  SynthResult result;
  result.bytes = total;
  result.shards = static_cast<int>(shards.size());
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

void WritePrequantized(const std::string& dir, const std::string& format) {
  if (format != "fp8" && format != "bnb-nf4")
    throw Error(ErrorCode::kInvalidArgument,
                "prequantized format `" + format + "` is not one of fp8, bnb-nf4");
  const bool fp8 = format == "fp8";
  const QuantInfo q = StoreQuantFormat(fp8 ? QuantMethod::kFp8 : QuantMethod::kNf4);
  std::vector<TensorToWrite> out;
  std::vector<std::vector<uint8_t>> owned;  // the new tensors' bytes
  auto emit = [&](const std::string& name, DType dtype, std::vector<int64_t> shape,
                  std::vector<uint8_t> bytes) {
    owned.push_back(std::move(bytes));
    out.push_back({name, dtype, std::move(shape), nullptr});
  };
  {
    const Checkpoint cp = Checkpoint::Open(dir);
    for (const Checkpoint::Ref& ref : cp.AllTensors()) {
      const SafetensorsEntry& e = *ref.entry;
      const size_t dot = e.name.find('.', std::string("model.layers.").size());
      const bool projection = e.name.rfind("model.layers.", 0) == 0 && dot != std::string::npos &&
                              IsProjectionWeight(e.name.substr(dot + 1));
      if (!projection) {
        const uint8_t* d = ref.file->Data(e);
        emit(e.name, e.dtype, e.shape, std::vector<uint8_t>(d, d + e.nbytes()));
        continue;
      }
      const int64_t rows = e.shape[0], cols = e.shape[1], n = rows * cols;
      std::vector<float> w(static_cast<size_t>(n));
      ConvertToFloat(e.dtype, ref.file->Data(e), w.data(), w.size());
      if (fp8) {
        const int64_t tr = (rows + 127) / 128, tc = (cols + 127) / 128;
        std::vector<uint8_t> qw(static_cast<size_t>(n)), scales(static_cast<size_t>(tr * tc) * 4);
        for (int64_t r = 0; r < rows; r += 128)
          QuantizeFp8Band(w.data() + r * cols, std::min<int64_t>(128, rows - r), cols, 128,
                          qw.data() + r * cols,
                          reinterpret_cast<float*>(scales.data()) + r / 128 * tc);
        emit(e.name, DType::kF8E4M3, e.shape, std::move(qw));
        emit(e.name + "_scale_inv", DType::kF32, {tr, tc}, std::move(scales));
        continue;
      }
      const int64_t blocks = (n + q.blocksize - 1) / q.blocksize;
      const int64_t groups = (blocks + q.nested_blocksize - 1) / q.nested_blocksize;
      std::vector<uint8_t> packed(static_cast<size_t>((n + 1) / 2)), absmax_q(blocks);
      std::vector<float> absmax(blocks), nested(groups);
      float offset = 0;
      QuantizeNf4(w.data(), n, q.blocksize, packed.data(), absmax.data());
      DoubleQuantizeAbsmax(absmax.data(), blocks, q.nested_blocksize, absmax_q.data(),
                           nested.data(), &offset);
      auto floats = [](const float* f, size_t count) {
        const auto* b = reinterpret_cast<const uint8_t*>(f);
        return std::vector<uint8_t>(b, b + count * 4);
      };
      const int64_t packed_rows = static_cast<int64_t>(packed.size());
      emit(e.name, DType::kU8, {packed_rows, 1}, std::move(packed));
      emit(e.name + ".absmax", DType::kU8, {blocks}, std::move(absmax_q));
      emit(e.name + ".nested_absmax", DType::kF32, {groups}, floats(nested.data(), nested.size()));
      emit(e.name + ".quant_map", DType::kF32, {16}, floats(kNf4Code.data(), 16));
      emit(e.name + ".nested_quant_map", DType::kF32, {256}, floats(DynamicMap8Bit().data(), 256));
      const std::string state = nlohmann::json{
          {"quant_type", "nf4"},
          {"blocksize", q.blocksize},
          {"dtype", "bfloat16"},
          {"shape", e.shape},
          {"nested_blocksize", q.nested_blocksize},
          {"nested_dtype", "float32"},
          {"nested_offset", offset}}.dump();
      emit(e.name + ".quant_state.bitsandbytes__nf4", DType::kU8,
           {static_cast<int64_t>(state.size())}, std::vector<uint8_t>(state.begin(), state.end()));
    }
    for (size_t i = 0; i < out.size(); ++i) out[i].data = owned[i].data();
    WriteSafetensors(dir + "/model.safetensors.tmp-quant", out, {{"format", "pt"}});
  }  // the old files' mappings are gone before they are removed
  for (const auto& entry : std::filesystem::directory_iterator(dir))
    if (entry.path().extension() == ".safetensors") std::filesystem::remove(entry.path());
  std::filesystem::remove(std::filesystem::path(dir) / "model.safetensors.index.json");
  std::filesystem::rename(dir + "/model.safetensors.tmp-quant", dir + "/model.safetensors");
  std::ifstream in(dir + "/config.json");
  nlohmann::json cj = nlohmann::json::parse(in);
  if (fp8)
    cj["quantization_config"] = {{"quant_method", "fp8"},
                                 {"fmt", "e4m3"},
                                 {"activation_scheme", "dynamic"},
                                 {"weight_block_size", {128, 128}}};
  else
    cj["quantization_config"] = {{"quant_method", "bitsandbytes"},
                                 {"load_in_4bit", true},
                                 {"load_in_8bit", false},
                                 {"bnb_4bit_quant_type", "nf4"},
                                 {"bnb_4bit_use_double_quant", true},
                                 {"bnb_4bit_compute_dtype", "bfloat16"},
                                 {"bnb_4bit_quant_storage", "uint8"}};
  WriteTextFile(dir + "/config.json", cj.dump(2));
}

}  // namespace lorastream::store
