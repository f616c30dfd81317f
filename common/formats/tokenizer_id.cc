#include "common/formats/tokenizer_id.h"

#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/base/error.h"
#include "common/formats/data.h"
#include "common/posix/regular_file.h"

namespace lorastream {
namespace {

using Json = nlohmann::json;
constexpr uint32_t kFlagTokenizerRecord =
    2;  // common/formats/data.h: a tokenizer record ends the file

uint64_t Fnv1a64(const std::string& text) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : text) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

int64_t MaxId(const Json& j) {
  int64_t max_id = -1;
  if (j.is_object()) {
    for (const auto& [token, id] : j.items())
      if (id.is_number_integer()) max_id = std::max(max_id, id.get<int64_t>());
  } else if (j.is_array()) {  // Unigram: [[piece, score], ...], the id is the index
    max_id = static_cast<int64_t>(j.size()) - 1;
  }
  return max_id;
}

TokenizerId RecordFromJson(const Json& r, const std::string& where) {
  if (!r.is_object() || !r.contains("fingerprint") || !r["fingerprint"].is_string() ||
      !r.contains("vocab_size") || !r["vocab_size"].is_number_integer())
    throw Error(ErrorCode::kCorrupt,
                where +
                    ": the tokenizer record needs a string `fingerprint` and an integer "
                    "`vocab_size`");
  TokenizerId id;
  id.fingerprint = r["fingerprint"].get<std::string>();
  id.vocab_size = r["vocab_size"].get<int64_t>();
  if (id.vocab_size <= 0)
    throw Error(ErrorCode::kCorrupt,
                where + ": the tokenizer record's `vocab_size` must be > 0 (found " +
                    std::to_string(id.vocab_size) + ")");
  if (r.contains("name") && r["name"].is_string()) id.name = r["name"].get<std::string>();
  return id;
}

std::optional<TokenizerId> JsonlRecord(const std::string& path) {
  // A FIFO or a device named as data would block or never end: refused at once, naming it.
  const UniqueFd fd = OpenRegularFile(path, "data.path");
  std::ifstream in(DescriptorPath(fd, path), std::ios::binary);
  if (!in) throw Error(ErrorCode::kNotFound, "data.path: cannot open " + path);
  std::string line;
  for (int64_t line_no = 1; std::getline(in, line); ++line_no) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = path + ":" + std::to_string(line_no);
    RequireNoNul(line, where);
    Json j = Json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_object() && j.contains("lorastream_tokenizer"))
      return RecordFromJson(j["lorastream_tokenizer"], where);
    return std::nullopt;  // only the first line may hold the record
  }
  return std::nullopt;
}

std::optional<TokenizerId> TokenFileRecord(const std::string& path) {
  // A FIFO or a device named as data would block or never end: refused at once, naming it.
  const UniqueFd fd = OpenRegularFile(path, "data.path");
  std::ifstream in(DescriptorPath(fd, path), std::ios::binary);
  if (!in) throw Error(ErrorCode::kNotFound, "data.path: cannot open " + path);
  uint8_t header[40];
  if (!in.read(reinterpret_cast<char*>(header), sizeof(header))) return std::nullopt;
  if (std::memcmp(header, "LSTOKEN\0", 8) != 0) return std::nullopt;  // the loader says why
  uint32_t token_bytes, flags;
  uint64_t num_docs, num_tokens;
  std::memcpy(&token_bytes, header + 12, 4);
  std::memcpy(&num_docs, header + 16, 8);
  std::memcpy(&num_tokens, header + 24, 8);
  std::memcpy(&flags, header + 32, 4);
  if (!(flags & kFlagTokenizerRecord)) return std::nullopt;
  auto bad = [&](const std::string& why) {
    return Error(ErrorCode::kCorrupt, path + ": not a valid token file: " + why);
  };
  in.seekg(0, std::ios::end);
  const uint64_t size = static_cast<uint64_t>(in.tellg());
  if (num_docs > size / 8 || num_tokens > size || (token_bytes != 2 && token_bytes != 4))
    throw bad("header counts larger than the file");
  const uint64_t at =
      40 + (num_docs + 1) * 8 + num_tokens * token_bytes + ((flags & 1) ? num_tokens : 0);
  uint32_t n = 0;
  in.seekg(static_cast<std::streamoff>(at));
  if (at + 4 > size || !in.read(reinterpret_cast<char*>(&n), 4) || at + 4 + n != size)
    throw bad("the tokenizer record does not end the file");
  std::string text(n, '\0');
  in.read(text.data(), n);
  Json j = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) throw bad("the tokenizer record is not JSON");
  return RecordFromJson(j, path);
}

std::string Describe(const TokenizerId& id) {
  return "tokenizer " + (id.name.empty() ? std::string("(unnamed)") : id.name) + " (fingerprint " +
         id.fingerprint + ", vocabulary " + std::to_string(id.vocab_size) + ")";
}

}  // namespace

std::optional<TokenizerId> ModelTokenizerId(const std::string& model_dir) {
  const std::filesystem::path dir(model_dir);
  const std::filesystem::path file = dir / "tokenizer.json";
  std::string text;
  try {
    text = ReadRegularFile(file.string(), kMaxTextFileBytes, "tokenizer.json");
  } catch (const Error& e) {
    // None, or not readable here: nothing to compare. One that is not a file says so.
    if (e.code() == ErrorCode::kNotFound || e.code() == ErrorCode::kIo) return std::nullopt;
    throw;
  }
  Json j = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object() || !j.contains("model"))
    throw Error(ErrorCode::kCorrupt, file.string() + " is not a Hugging Face tokenizer.json");
  Json parts = Json::object();  // std::map-backed: dump() sorts keys at every level
  for (const char* key : {"model", "normalizer", "pre_tokenizer", "post_processor", "added_tokens"})
    parts[key] = j.contains(key) ? j[key] : Json();
  TokenizerId id;
  id.name = (dir.has_filename() ? dir : dir.parent_path()).filename().string();
  char hex[24];
  std::snprintf(hex, sizeof(hex), "%016" PRIx64, Fnv1a64(parts.dump()));
  id.fingerprint = std::string("tok-") + hex;
  int64_t max_id = j["model"].contains("vocab") ? MaxId(j["model"]["vocab"]) : -1;
  if (j.contains("added_tokens") && j["added_tokens"].is_array())
    for (const Json& t : j["added_tokens"])
      if (t.is_object() && t.contains("id") && t["id"].is_number_integer())
        max_id = std::max(max_id, t["id"].get<int64_t>());
  id.vocab_size = max_id + 1;
  return id;
}

std::optional<TokenizerId> DataTokenizerId(const std::string& data_path,
                                           const std::string& format) {
  if (format == "jsonl") return JsonlRecord(data_path);
  if (format == "tokens") return TokenFileRecord(data_path);
  return std::nullopt;
}

std::string TokenizerMismatch(const std::optional<TokenizerId>& model,
                              const std::string& model_what, int64_t model_vocab_size,
                              const std::optional<TokenizerId>& data,
                              const std::string& data_path) {
  if (!data) return "";
  if (model && !model->fingerprint.empty()) {
    if (model->fingerprint == data->fingerprint) return "";
    return data_path + " was prepared with " + Describe(*data) + ", but " + model_what + " uses " +
           Describe(*model) +
           ": prepare the data again with `lorastream prepare "
           "--model` naming this model's folder";
  }
  if (model_vocab_size > 0 && data->vocab_size > model_vocab_size)
    return data_path + " was prepared with " + Describe(*data) + ", larger than the vocab_size " +
           std::to_string(model_vocab_size) + " of " + model_what +
           " (which has no tokenizer.json to compare with)";
  return "";
}

std::string DataTokenizerProblem(const std::string& data_path, const std::string& format,
                                 const std::function<std::optional<TokenizerId>()>& model_tokenizer,
                                 const std::string& model_what, int64_t model_vocab_size) {
  try {
    std::optional<TokenizerId> data = DataTokenizerId(data_path, format);
    if (!data) return "";
    return TokenizerMismatch(model_tokenizer(), model_what, model_vocab_size, data, data_path);
  } catch (const Error& e) {
    return e.what();
  }
}

}  // namespace lorastream
