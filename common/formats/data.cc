#include "common/formats/data.h"

#include <cstring>
#include <fstream>
#include <iterator>

#include <nlohmann/json.hpp>

#include "common/base/error.h"
#include "common/posix/regular_file.h"

namespace lorastream {

namespace {

using Json = nlohmann::json;
constexpr char kMagic[8] = {'L', 'S', 'T', 'O', 'K', 'E', 'N', '\0'};
constexpr uint64_t kHeaderBytes = 40;

uint64_t SplitMix(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

std::vector<int32_t> IntArray(const Json& j, const char* field, const std::string& where,
                              int64_t lo, int64_t hi, bool allow_ignore) {
  const Json& a = j.at(field);
  if (!a.is_array())
    throw Error(ErrorCode::kCorrupt, where + ": `" + field + "` must be an array of integers");
  std::vector<int32_t> out;
  out.reserve(a.size());
  for (size_t k = 0; k < a.size(); ++k) {
    const Json& v = a[k];
    if (!v.is_number_integer())
      throw Error(ErrorCode::kCorrupt,
                  where + ": `" + field + "`[" + std::to_string(k) + "] is not an integer");
    int64_t x = v.get<int64_t>();
    if (allow_ignore && x == kIgnoreIndex) {
      out.push_back(kIgnoreIndex);
      continue;
    }
    if (x < lo || x >= hi)
      throw Error(ErrorCode::kRefused,
                  where + ": `" + field + "`[" + std::to_string(k) + "] = " + std::to_string(x) +
                      " is outside [" + std::to_string(lo) + ", " + std::to_string(hi) + ")" +
                      (hi > 1 ? " (the model's vocab_size is " + std::to_string(hi) +
                                    "; data tokenized for another model?)"
                              : std::string()));
    out.push_back(static_cast<int32_t>(x));
  }
  return out;
}

std::vector<Document> LoadJsonl(const std::string& path, int64_t vocab) {
  // A FIFO or a device named as data would block or never end: refused at once, naming it.
  const UniqueFd fd = OpenRegularFile(path, "data.path");
  std::ifstream in(DescriptorPath(fd, path), std::ios::binary);
  if (!in) throw Error(ErrorCode::kNotFound, "data.path: cannot open " + path);
  std::vector<Document> docs;
  std::string line;
  int64_t line_no = 0;
  bool first = true;
  while (std::getline(in, line)) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const bool may_be_record = first;
    first = false;
    const std::string where = path + ":" + std::to_string(line_no);
    RequireNoNul(line, where);
    Json j = Json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object())
      throw Error(ErrorCode::kCorrupt, where + ": not a JSON object");
    // `lorastream prepare`'s record of the tokenizer (common/formats/tokenizer_id.h), not a
    // document.
    if (may_be_record && j.contains("lorastream_tokenizer") && !j.contains("input_ids")) continue;
    if (!j.contains("input_ids"))
      throw Error(ErrorCode::kCorrupt, where + ": `input_ids` is missing");
    Document d;
    d.ids = IntArray(j, "input_ids", where, 0, vocab, false);
    if (j.contains("labels") && j.contains("loss_mask"))
      throw Error(ErrorCode::kCorrupt, where + ": give `labels` or `loss_mask`, not both");
    if (j.contains("labels")) {
      d.labels = IntArray(j, "labels", where, 0, vocab, true);
    } else if (j.contains("loss_mask")) {
      auto mask = IntArray(j, "loss_mask", where, 0, 2, false);
      if (mask.size() != d.ids.size())
        throw Error(ErrorCode::kCorrupt,
                    where + ": `loss_mask` has " + std::to_string(mask.size()) +
                        " entries, `input_ids` " + std::to_string(d.ids.size()));
      d.labels.resize(d.ids.size());
      for (size_t k = 0; k < mask.size(); ++k) d.labels[k] = mask[k] ? d.ids[k] : kIgnoreIndex;
    } else {
      d.labels = d.ids;
    }
    if (d.labels.size() != d.ids.size())
      throw Error(ErrorCode::kCorrupt, where + ": `labels` has " + std::to_string(d.labels.size()) +
                                           " entries, `input_ids` " + std::to_string(d.ids.size()));
    if (!d.ids.empty()) docs.push_back(std::move(d));
  }
  return docs;
}

template <class T>
T ReadLe(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));  // the project targets little-endian hosts
  return v;
}

std::vector<Document> LoadTokenFile(const std::string& path, int64_t vocab) {
  // A FIFO or a device named as data would block or never end: refused at once, naming it.
  const UniqueFd fd = OpenRegularFile(path, "data.path");
  std::ifstream in(DescriptorPath(fd, path), std::ios::binary);
  if (!in) throw Error(ErrorCode::kNotFound, "data.path: cannot open " + path);
  std::vector<uint8_t> buf((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto bad = [&](const std::string& why) {
    return Error(ErrorCode::kCorrupt, path + ": not a valid token file: " + why);
  };
  if (buf.size() < kHeaderBytes) throw bad("shorter than its 40-byte header");
  if (std::memcmp(buf.data(), kMagic, 8) != 0) throw bad("wrong magic (expected \"LSTOKEN\")");
  const uint32_t version = ReadLe<uint32_t>(&buf[8]);
  const uint32_t token_bytes = ReadLe<uint32_t>(&buf[12]);
  const uint64_t num_docs = ReadLe<uint64_t>(&buf[16]);
  const uint64_t num_tokens = ReadLe<uint64_t>(&buf[24]);
  const uint32_t flags = ReadLe<uint32_t>(&buf[32]);
  if (version != 1) throw bad("version " + std::to_string(version) + " (this build reads 1)");
  if (token_bytes != 2 && token_bytes != 4) throw bad("token_bytes must be 2 or 4");
  if (flags > 3) throw bad("unknown flags");
  const uint64_t size = buf.size();
  if (num_docs > size / 8 || num_tokens > size) throw bad("counts larger than the file");
  const uint64_t offsets_end = kHeaderBytes + (num_docs + 1) * 8;
  const uint64_t tokens_end = offsets_end + num_tokens * token_bytes;
  uint64_t expected = tokens_end + ((flags & 1) ? num_tokens : 0);
  if ((flags & 2) && expected + 4 <= size)  // the tokenizer record: u32 byte count + JSON
    expected += 4 + ReadLe<uint32_t>(&buf[expected]);
  if (expected != size)
    throw bad("size " + std::to_string(size) + " bytes, the header implies " +
              std::to_string(expected));
  std::vector<Document> docs;
  uint64_t prev = ReadLe<uint64_t>(&buf[kHeaderBytes]);
  if (prev != 0) throw bad("offsets[0] must be 0");
  for (uint64_t d = 0; d < num_docs; ++d) {
    const uint64_t end = ReadLe<uint64_t>(&buf[kHeaderBytes + (d + 1) * 8]);
    if (end < prev || end > num_tokens)
      throw bad("offsets[" + std::to_string(d + 1) + "] out of order or past num_tokens");
    Document doc;
    for (uint64_t k = prev; k < end; ++k) {
      const uint8_t* p = &buf[offsets_end + k * token_bytes];
      const uint32_t id = token_bytes == 2 ? ReadLe<uint16_t>(p) : ReadLe<uint32_t>(p);
      if (static_cast<int64_t>(id) >= vocab)
        throw Error(ErrorCode::kRefused, path + ": document " + std::to_string(d) + ", token " +
                                             std::to_string(k - prev) + " = " + std::to_string(id) +
                                             " is outside the model's vocabulary (vocab_size " +
                                             std::to_string(vocab) +
                                             "; data tokenized for another model?)");
      doc.ids.push_back(static_cast<int32_t>(id));
      const bool target = !(flags & 1) || buf[tokens_end + k] != 0;
      doc.labels.push_back(target ? static_cast<int32_t>(id) : kIgnoreIndex);
    }
    if (!doc.ids.empty()) docs.push_back(std::move(doc));
    prev = end;
  }
  if (prev != num_tokens) throw bad("offsets[num_docs] must equal num_tokens");
  return docs;
}

}  // namespace

void RequireNoNul(std::string_view line, const std::string& where) {
  if (const size_t at = line.find('\0'); at != std::string_view::npos)
    throw Error(ErrorCode::kCorrupt, where + ": a NUL byte at column " + std::to_string(at + 1) +
                                         " (a JSONL line holds one JSON object and nothing else)");
}

std::vector<Document> LoadDocuments(const std::string& path, const std::string& format,
                                    int64_t vocab_size) {
  std::vector<Document> docs;
  if (format == "jsonl")
    docs = LoadJsonl(path, vocab_size);
  else if (format == "tokens")
    docs = LoadTokenFile(path, vocab_size);
  else
    throw Error(ErrorCode::kRefused, "data.format must be \"jsonl\" or \"tokens\"");
  if (docs.empty()) throw Error(ErrorCode::kRefused, "data.path: " + path + " holds no tokens");
  return docs;
}

void WriteTokenFile(const std::string& path, const std::vector<Document>& docs, int token_bytes,
                    bool with_mask) {
  LS_CHECK(token_bytes == 2 || token_bytes == 4, "token_bytes must be 2 or 4");
  std::vector<uint8_t> out(kHeaderBytes, 0);
  std::memcpy(out.data(), kMagic, 8);
  uint64_t num_tokens = 0;
  for (const auto& d : docs) num_tokens += d.ids.size();
  auto put = [&](size_t at, auto v) { std::memcpy(&out[at], &v, sizeof(v)); };
  put(8, uint32_t{1});
  put(12, static_cast<uint32_t>(token_bytes));
  put(16, static_cast<uint64_t>(docs.size()));
  put(24, num_tokens);
  put(32, static_cast<uint32_t>(with_mask ? 1 : 0));
  auto append = [&](const void* p, size_t n) {
    const uint8_t* b = static_cast<const uint8_t*>(p);
    out.insert(out.end(), b, b + n);
  };
  uint64_t offset = 0;
  append(&offset, 8);
  for (const auto& d : docs) {
    offset += d.ids.size();
    append(&offset, 8);
  }
  for (const auto& d : docs)
    for (int32_t id : d.ids) {
      if (token_bytes == 2) {
        LS_CHECK(id >= 0 && id < 65536, "token id does not fit u16");
        uint16_t v = static_cast<uint16_t>(id);
        append(&v, 2);
      } else {
        uint32_t v = static_cast<uint32_t>(id);
        append(&v, 4);
      }
    }
  if (with_mask)
    for (const auto& d : docs)
      for (size_t k = 0; k < d.ids.size(); ++k) {
        uint8_t m = d.labels.empty() || d.labels[k] != kIgnoreIndex ? 1 : 0;
        append(&m, 1);
      }
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) ThrowErrno("cannot write " + tmp);
    f.write(reinterpret_cast<const char*>(out.data()), static_cast<std::streamsize>(out.size()));
    if (!f) ThrowErrno("cannot write " + tmp);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) ThrowErrno("cannot rename " + tmp);
}

SequenceSet BuildSequences(const std::vector<Document>& docs, int64_t seq_len, bool packing,
                           int32_t pad_id) {
  LS_CHECK(seq_len > 0, "seq_len > 0");
  SequenceSet s;
  s.seq_len = seq_len;
  auto pad_to_full = [&]() {
    while (static_cast<int64_t>(s.ids.size()) % seq_len != 0) {
      s.ids.push_back(pad_id);
      s.labels.push_back(kIgnoreIndex);
    }
  };
  for (const auto& d : docs) {
    const size_t n = packing ? d.ids.size() : std::min<size_t>(d.ids.size(), seq_len);
    s.ids.insert(s.ids.end(), d.ids.begin(), d.ids.begin() + n);
    s.labels.insert(s.labels.end(), d.labels.begin(), d.labels.begin() + n);
    if (!packing) pad_to_full();
  }
  pad_to_full();
  s.count = static_cast<int64_t>(s.ids.size()) / seq_len;
  return s;
}

Sampler::Sampler(int64_t count, uint64_t seed) : count_(count), seed_(seed) {
  LS_CHECK(count > 0, "a sampler over no sequences");
}

int64_t Sampler::Index(int64_t position) {
  const int64_t epoch = position / count_;
  if (epoch != epoch_) {
    // Fisher-Yates with a splitmix64 stream of (seed, epoch): the same on every platform.
    order_.resize(count_);
    for (int64_t i = 0; i < count_; ++i) order_[i] = i;
    uint64_t state = SplitMix(seed_ ^ SplitMix(static_cast<uint64_t>(epoch) + 0x5eed));
    for (int64_t i = count_ - 1; i > 0; --i) {
      state = SplitMix(state);
      std::swap(order_[i], order_[state % static_cast<uint64_t>(i + 1)]);
    }
    epoch_ = epoch;
  }
  return order_[position % count_];
}

Batch MakeBatch(const SequenceSet& set, Sampler& sampler, int64_t position, int64_t rows) {
  std::vector<int64_t> indices(rows);
  for (int64_t r = 0; r < rows; ++r) indices[r] = sampler.Index(position + r);
  return MakeBatchOf(set, indices);
}

Batch MakeBatchOf(const SequenceSet& set, const std::vector<int64_t>& indices) {
  const int64_t rows = static_cast<int64_t>(indices.size());
  Batch b;
  b.rows = rows;
  b.seq_len = set.seq_len;
  b.ids.resize(rows * set.seq_len);
  b.targets.resize(rows * set.seq_len);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t idx = indices[r];
    LS_CHECK(idx >= 0 && idx < set.count, "batch sequence index out of range");
    const int32_t* ids = &set.ids[idx * set.seq_len];
    const int32_t* labels = &set.labels[idx * set.seq_len];
    for (int64_t k = 0; k < set.seq_len; ++k) {
      b.ids[r * set.seq_len + k] = ids[k];
      const int64_t t = k + 1 < set.seq_len ? labels[k + 1] : kIgnoreIndex;
      b.targets[r * set.seq_len + k] = t;
      if (t != kIgnoreIndex) ++b.n_targets;
    }
  }
  return b;
}

}  // namespace lorastream
