// The safetensors header parser: every field is checked before the reader trusts it, and
// each kind of damage gets its own message naming the source and the tensor.
#include "common/formats/safetensors.h"

#include <algorithm>
#include <set>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/base/error.h"

namespace lorastream {

namespace {

using Json = nlohmann::json;

// Headers nest three levels ({name: {shape: [..]}}); anything much deeper is garbage, and
// refusing it up front keeps the JSON parser far from any recursion limit.
constexpr int kMaxHeaderNesting = 32;

[[noreturn]] void Corrupt(const std::string& source, const std::string& what) {
  throw Error(ErrorCode::kCorrupt, source + ": " + what);
}

[[noreturn]] void CorruptTensor(const std::string& source, const std::string& name,
                                const std::string& what) {
  throw Error(ErrorCode::kCorrupt, source + ": tensor `" + name + "`: " + what);
}

uint64_t ReadLe64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// Maximum bracket nesting outside of strings.
int MaxNesting(const char* text, size_t n) {
  int depth = 0, max_depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < n; ++i) {
    char c = text[i];
    if (in_string) {
      if (c == '\\')
        ++i;
      else if (c == '"')
        in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      max_depth = std::max(max_depth, ++depth);
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return max_depth;
}

void ParseMetadata(const Json& value, const std::string& source,
                   std::map<std::string, std::string>* out) {
  if (!value.is_object()) Corrupt(source, "`__metadata__` must be an object of strings");
  for (auto it = value.begin(); it != value.end(); ++it) {
    if (!it.value().is_string())
      Corrupt(source, "`__metadata__` key `" + it.key() + "` is not a string");
    (*out)[it.key()] = it.value().get<std::string>();
  }
}

SafetensorsEntry ParseEntry(const std::string& name, const Json& value, uint64_t data_size,
                            const std::string& source) {
  if (name.empty()) Corrupt(source, "a tensor has an empty name");
  if (!value.is_object()) CorruptTensor(source, name, "entry is not an object");
  SafetensorsEntry e;
  e.name = name;
  auto dt = value.find("dtype");
  if (dt == value.end() || !dt->is_string())
    CorruptTensor(source, name, "`dtype` is missing or not a string");
  auto dtype = ParseDType(dt->get<std::string>());
  if (!dtype) CorruptTensor(source, name, "unknown dtype `" + dt->get<std::string>() + "`");
  e.dtype = *dtype;

  auto shape = value.find("shape");
  if (shape == value.end() || !shape->is_array())
    CorruptTensor(source, name, "`shape` is missing or not an array");
  uint64_t numel = 1;
  bool overflow = false;
  for (const Json& d : *shape) {
    if (!d.is_number_unsigned())
      CorruptTensor(source, name, "`shape` must hold non-negative integers");
    uint64_t v = d.get<uint64_t>();
    if (v > (uint64_t{1} << 48)) overflow = true;
    e.shape.push_back(static_cast<int64_t>(v));
    if (!overflow && v != 0 && numel > (uint64_t{1} << 56) / v) overflow = true;
    if (!overflow) numel *= v;
  }
  if (overflow) CorruptTensor(source, name, "shape " + ShapeString(e.shape) + " is too large");

  auto offsets = value.find("data_offsets");
  if (offsets == value.end() || !offsets->is_array() || offsets->size() != 2 ||
      !(*offsets)[0].is_number_unsigned() || !(*offsets)[1].is_number_unsigned())
    CorruptTensor(source, name, "`data_offsets` must be [begin, end] of non-negative integers");
  e.begin = (*offsets)[0].get<uint64_t>();
  e.end = (*offsets)[1].get<uint64_t>();
  if (e.begin > e.end)
    CorruptTensor(
        source, name,
        "data_offsets begin " + std::to_string(e.begin) + " is after end " + std::to_string(e.end));
  if (e.end > data_size)
    CorruptTensor(source, name,
                  "data_offsets end " + std::to_string(e.end) + " is past the data section (" +
                      std::to_string(data_size) + " bytes)");
  const uint64_t expected = numel * DTypeSize(e.dtype);
  if (expected != e.nbytes())
    CorruptTensor(source, name,
                  "shape " + ShapeString(e.shape) + " of " + DTypeName(e.dtype) + " needs " +
                      std::to_string(expected) + " bytes but data_offsets span " +
                      std::to_string(e.nbytes()));
  return e;
}

}  // namespace

uint64_t SafetensorsEntry::numel() const {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

SafetensorsHeader ParseSafetensorsHeader(const uint8_t* data, size_t size,
                                         const std::string& source) {
  if (size < 8)
    Corrupt(source,
            "file is " + std::to_string(size) + " bytes, too short for the 8-byte header length");
  const uint64_t n = ReadLe64(data);
  if (n > kMaxSafetensorsHeaderBytes)
    Corrupt(source, "header length " + std::to_string(n) + " exceeds the cap of " +
                        std::to_string(kMaxSafetensorsHeaderBytes) + " bytes");
  if (n > size - 8)
    Corrupt(source, "header length " + std::to_string(n) + " runs past the end of the file (" +
                        std::to_string(size) + " bytes)");
  if (n == 0) Corrupt(source, "header is empty (length 0)");
  const char* text = reinterpret_cast<const char*>(data + 8);
  if (MaxNesting(text, n) > kMaxHeaderNesting)
    Corrupt(source,
            "header JSON nests deeper than " + std::to_string(kMaxHeaderNesting) + " levels");

  // Duplicate keys are silently merged by JSON parsers; a stack of key sets catches them.
  std::vector<std::set<std::string>> keys;
  std::string duplicate;
  int duplicate_depth = 0;
  auto on_event = [&](int depth, Json::parse_event_t event, Json& parsed) {
    if (event == Json::parse_event_t::object_start)
      keys.emplace_back();
    else if (event == Json::parse_event_t::object_end && !keys.empty())
      keys.pop_back();
    else if (event == Json::parse_event_t::key && !keys.empty() && duplicate.empty() &&
             parsed.is_string() && !keys.back().insert(parsed.get<std::string>()).second) {
      duplicate = parsed.get<std::string>();
      duplicate_depth = depth;
    }
    return true;
  };
  Json j = Json::parse(text, text + n, on_event, /*allow_exceptions=*/false);
  if (j.is_discarded()) Corrupt(source, "header is not valid JSON");
  if (!duplicate.empty()) {
    if (duplicate_depth <= 1)
      Corrupt(source, "tensor `" + duplicate + "` appears twice in the header");
    Corrupt(source, "key `" + duplicate + "` appears twice in one header entry");
  }
  if (!j.is_object()) Corrupt(source, "header JSON is not an object");

  SafetensorsHeader header;
  header.data_offset = 8 + n;
  const uint64_t data_size = size - header.data_offset;
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() == "__metadata__") {
      ParseMetadata(it.value(), source, &header.metadata);
      continue;
    }
    header.tensors.push_back(ParseEntry(it.key(), it.value(), data_size, source));
  }
  std::sort(header.tensors.begin(), header.tensors.end(),
            [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
              return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
            });
  // Sorted by begin, a tensor overlaps another iff it starts before its predecessor ends.
  // Empty tensors occupy no bytes and overlap nothing.
  const SafetensorsEntry* previous = nullptr;
  for (const SafetensorsEntry& e : header.tensors) {
    if (e.nbytes() == 0) continue;
    if (previous && e.begin < previous->end)
      Corrupt(source, "tensors `" + previous->name + "` [" + std::to_string(previous->begin) +
                          ", " + std::to_string(previous->end) + ") and `" + e.name + "` [" +
                          std::to_string(e.begin) + ", " + std::to_string(e.end) + ") overlap");
    previous = &e;
  }
  return header;
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace lorastream
