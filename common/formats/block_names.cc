#include "common/formats/block_names.h"

#include <algorithm>
#include <map>
#include <sstream>

#include "common/base/error.h"

namespace lorastream {

std::optional<int64_t> ParseDecimal(const std::string& text) {
  if (text.empty() || text.size() > 18) return std::nullopt;
  for (char ch : text)
    if (ch < '0' || ch > '9') return std::nullopt;
  return std::stoll(text);
}

int64_t CountNumberedBlocks(const SafetensorsHeader& h, const std::string& prefix,
                            int64_t max_blocks, const std::string& source) {
  int64_t n = 0;
  for (const auto& t : h.tensors)
    if (t.name.compare(0, prefix.size(), prefix) == 0) {
      const size_t dot = t.name.find('.', prefix.size());
      const std::string digits = t.name.substr(prefix.size(), dot - prefix.size());
      const std::optional<int64_t> index = ParseDecimal(digits);
      if (!index)
        throw Error(ErrorCode::kCorrupt, source + ": tensor `" + t.name + "`: block index `" +
                                             digits + "` is not a number");
      const int64_t limit = std::min<int64_t>(max_blocks, static_cast<int64_t>(h.tensors.size()));
      if (*index >= limit)
        throw Error(ErrorCode::kCorrupt,
                    source + ": tensor `" + t.name + "`: block index " + digits + " is not below " +
                        std::to_string(limit) + " (at most " + std::to_string(max_blocks) +
                        " blocks of a kind, and no more than " + "the file's " +
                        std::to_string(h.tensors.size()) + " tensors)");
      n = std::max<int64_t>(n, *index + 1);
    }
  return n;
}

bool SplitNumberedName(const std::string& name, const std::string& prefix, std::string* rest) {
  if (name.compare(0, prefix.size(), prefix) != 0) return false;
  size_t i = prefix.size();
  while (i < name.size() && i - prefix.size() < 9 && name[i] >= '0' && name[i] <= '9') ++i;
  if (i == prefix.size() || i >= name.size() || name[i] != '.') return false;
  *rest = name.substr(i + 1);
  return true;
}

std::array<int64_t, 3> ParseAxesDim(const std::string& text, const std::string& key,
                                    int64_t head_dim, const std::string& source) {
  std::array<int64_t, 3> out{};
  std::stringstream ss(text);
  std::string part;
  for (int i = 0; i < 3; ++i) {
    const std::optional<int64_t> v =
        std::getline(ss, part, ',') ? ParseDecimal(part) : std::optional<int64_t>();
    if (!v || *v <= 0 || *v % 2 != 0 || *v > head_dim)
      throw Error(ErrorCode::kCorrupt, source + ": metadata `" + key + "` `" + text +
                                           "` is not three positive even numbers of at most "
                                           "head_dim (" +
                                           std::to_string(head_dim) + ") each, like 16,56,56");
    out[i] = *v;
  }
  if (std::getline(ss, part, ','))
    throw Error(ErrorCode::kCorrupt,
                source + ": metadata `" + key + "` `" + text + "` holds more than three numbers");
  return out;
}

const std::vector<int64_t>* HeaderShape(const SafetensorsHeader& h, const std::string& name) {
  for (const auto& t : h.tensors)
    if (t.name == name) return &t.shape;
  return nullptr;
}

void RequireExactTensors(const TensorShapes& have, const TensorShapes& want,
                         const std::string& source, const std::string& model) {
  std::map<std::string, const std::vector<int64_t>*> by_name;
  for (const auto& [name, shape] : have) by_name[name] = &shape;
  for (const auto& [name, shape] : want) {
    auto it = by_name.find(name);
    if (it == by_name.end())
      throw Error(ErrorCode::kCorrupt, source + ": missing tensor `" + name + "`");
    if (*it->second != shape)
      throw Error(ErrorCode::kCorrupt, source + ": tensor `" + name + "` has shape " +
                                           ShapeString(*it->second) + ", expected " +
                                           ShapeString(shape));
    by_name.erase(it);
  }
  for (const auto& [name, shape] : have)
    if (by_name.count(name))
      throw Error(ErrorCode::kCorrupt,
                  source + ": unexpected tensor `" + name + "` (not part of " + model + ")");
}

const std::vector<std::string>& RequireKnownTargets(const std::vector<std::string>& spec,
                                                    const std::vector<std::string>& known,
                                                    const std::string& presets,
                                                    const std::string& model,
                                                    const std::string& where) {
  if (spec.empty()) throw Error(ErrorCode::kRefused, where + ": names no module to adapt");
  for (const auto& s : spec)
    if (std::find(known.begin(), known.end(), s) == known.end()) {
      std::string list;
      for (auto& k : known) list += (list.empty() ? "" : ", ") + k;
      throw Error(ErrorCode::kRefused, where + ": `" + s + "` is not a linear layer of " + model +
                                           " (" + presets + " or some of: " + list + ")");
    }
  return spec;
}

}  // namespace lorastream
