#include "common/formats/toml_file.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "common/base/error.h"
#include "common/base/format_bytes.h"
#include "common/posix/regular_file.h"

namespace lorastream {

namespace {
const char* TypeName(const toml::node& node) {
  switch (node.type()) {
    case toml::node_type::table:
      return "a table";
    case toml::node_type::array:
      return "an array";
    case toml::node_type::string:
      return "a string";
    case toml::node_type::integer:
      return "an integer";
    case toml::node_type::floating_point:
      return "a float";
    case toml::node_type::boolean:
      return "a boolean";
    default:
      return "a date/time";
  }
}
}  // namespace

void CheckTomlLimits(const std::string& text, const std::string& source_name) {
  if (text.size() > kMaxTomlBytes)
    throw Error(ErrorCode::kCorrupt, source_name + " is " + FormatBytes(text.size()) +
                                         ", above the limit of " + FormatBytes(kMaxTomlBytes) +
                                         " for a TOML file");
  // A scan that knows strings, comments, keys and brackets, nothing more: the depth of a value
  // is the segments of its table's header, plus those of the dotted keys and one per array or
  // inline table leading to it. It throws on the first level past the limit, so its own
  // stack stays small whatever the text.
  int line = 1;
  const auto too_deep = [&] {
    throw Error(ErrorCode::kCorrupt,
                source_name + ":" + std::to_string(line) + ": nests deeper than " +
                    std::to_string(kMaxTomlDepth) +
                    " levels (tables, dotted keys, arrays, inline tables): refused before parsing");
  };
  std::vector<std::pair<char, int>> open;  // '[' or '{', and the depth it added
  int table_depth = 0, open_depth = 0;     // the header's segments; what `open` adds
  int key_segments = 0;                    // of the key being read (0: none yet)
  int pending = 0;                         // segments of the key whose value follows
  bool in_key = true, in_header = false;
  const size_t n = text.size();
  for (size_t i = 0; i < n; ++i) {
    const char c = text[i];
    if (c == '\n') {
      ++line;
      if (open.empty()) in_key = true, in_header = false, key_segments = 0, pending = 0;
      continue;
    }
    if (c == '#') {
      while (i + 1 < n && text[i + 1] != '\n') ++i;
      continue;
    }
    if (c == '"' || c == '\'') {
      const bool multi = i + 2 < n && text[i + 1] == c && text[i + 2] == c;
      if (in_key || in_header) key_segments = std::max(key_segments, 1);
      if (multi) {
        i += 3;
        while (i < n && !(text[i] == c && i + 2 < n && text[i + 1] == c && text[i + 2] == c)) {
          if (text[i] == '\n') ++line;
          if (c == '"' && text[i] == '\\') ++i;
          ++i;
        }
        i += 2;
      } else {
        ++i;
        while (i < n && text[i] != c && text[i] != '\n') {
          if (c == '"' && text[i] == '\\') ++i;
          ++i;
        }
        if (i < n && text[i] == '\n') --i;  // unterminated: the newline is seen above
      }
      continue;
    }
    if (c == ' ' || c == '\t' || c == '\r') continue;
    if (in_header) {
      if (c == '.') {
        if (++key_segments > kMaxTomlDepth) too_deep();
      } else if (c == ']') {
        table_depth += key_segments;  // an array of tables ([[...]]) began with one level
        if (table_depth > kMaxTomlDepth) too_deep();
        in_header = false;
        while (i + 1 < n && text[i + 1] == ']') ++i;
      } else if (c != '[') {
        key_segments = std::max(key_segments, 1);
      }
      continue;
    }
    if (in_key) {
      if (c == '[' && open.empty() && key_segments == 0) {
        in_header = true;
        in_key = false;
        table_depth = (i + 1 < n && text[i + 1] == '[') ? 1 : 0;
        continue;
      }
      if (c == '.') {
        if (table_depth + open_depth + ++key_segments > kMaxTomlDepth) too_deep();
      } else if (c == '=') {
        if (table_depth + open_depth + key_segments > kMaxTomlDepth) too_deep();
        pending = key_segments;
        key_segments = 0;
        in_key = false;
      } else if (c == '}' && !open.empty()) {  // an empty inline table: `{}`
        open_depth -= open.back().second;
        open.pop_back();
        in_key = false;
      } else {
        key_segments = std::max(key_segments, 1);
      }
      continue;
    }
    if (c == '[' || c == '{') {
      open.emplace_back(c, pending + 1);
      open_depth += pending + 1;
      pending = 0;
      if (table_depth + open_depth > kMaxTomlDepth) too_deep();
      if (c == '{') in_key = true, key_segments = 0;
    } else if ((c == ']' || c == '}') && !open.empty()) {
      open_depth -= open.back().second;
      open.pop_back();
    } else if (c == ',' && !open.empty() && open.back().first == '{') {
      in_key = true;
      key_segments = 0;
    }
  }
}

TomlSection::TomlSection(std::shared_ptr<toml::table> root, const toml::table* table,
                         std::shared_ptr<std::string> file, std::string prefix)
    : root_(std::move(root)), table_(table), file_(std::move(file)), prefix_(std::move(prefix)) {}

TomlSection TomlSection::Parse(const std::string& text, const std::string& source_name) {
  // toml++ is built with exceptions here: parse() throws toml::parse_error.
  CheckTomlLimits(text, source_name);
  std::shared_ptr<toml::table> root;
  try {
    root = std::make_shared<toml::table>(toml::parse(text, source_name));
  } catch (const toml::parse_error& err) {
    std::ostringstream msg;
    msg << source_name << ":" << err.source().begin.line << ":" << err.source().begin.column
        << ": TOML syntax error: " << err.description();
    throw Error(ErrorCode::kCorrupt, msg.str());
  }
  const toml::table* table = root.get();
  return TomlSection(root, table, std::make_shared<std::string>(source_name), "");
}

TomlSection TomlSection::Load(const std::string& path) {
  return Parse(ReadRegularFile(path, kMaxTomlBytes), path);
}

std::string TomlSection::Where(const std::string& key) const {
  return *file_ + ": key `" + prefix_ + key + "`";
}

void TomlSection::Mismatch(const std::string& key, const char* expected) const {
  // A value of the wrong type is invalid input (exit 2), not a damaged file.
  throw Error(ErrorCode::kInvalidArgument,
              Where(key) + " must be " + expected + ", found " + TypeName(*table_->get(key)));
}

const toml::node* TomlSection::Find(const std::string& key) const {
  return table_ ? table_->get(key) : nullptr;
}

bool TomlSection::Has(const std::string& key) const { return Find(key) != nullptr; }

TomlSection TomlSection::Section(const std::string& key) const {
  const toml::node* node = Find(key);
  if (!node) return TomlSection(root_, nullptr, file_, prefix_ + key + ".");
  if (!node->is_table()) Mismatch(key, "a table");
  return TomlSection(root_, node->as_table(), file_, prefix_ + key + ".");
}

std::string TomlSection::RequireString(const std::string& key) const {
  if (!Find(key)) throw Error(ErrorCode::kInvalidArgument, Where(key) + " is required (a string)");
  return GetString(key, "");
}

std::string TomlSection::GetString(const std::string& key, const std::string& fallback) const {
  const toml::node* node = Find(key);
  if (!node) return fallback;
  if (!node->is_string()) Mismatch(key, "a string");
  return node->as_string()->get();
}

int64_t TomlSection::RequireInt(const std::string& key) const {
  if (!Find(key))
    throw Error(ErrorCode::kInvalidArgument, Where(key) + " is required (an integer)");
  return GetInt(key, 0);
}

int64_t TomlSection::GetInt(const std::string& key, int64_t fallback) const {
  const toml::node* node = Find(key);
  if (!node) return fallback;
  if (!node->is_integer()) Mismatch(key, "an integer");
  return node->as_integer()->get();
}

double TomlSection::GetDouble(const std::string& key, double fallback) const {
  const toml::node* node = Find(key);
  if (!node) return fallback;
  if (node->is_integer()) return static_cast<double>(node->as_integer()->get());
  if (!node->is_floating_point()) Mismatch(key, "a number");
  return node->as_floating_point()->get();
}

bool TomlSection::GetBool(const std::string& key, bool fallback) const {
  const toml::node* node = Find(key);
  if (!node) return fallback;
  if (!node->is_boolean()) Mismatch(key, "a boolean");
  return node->as_boolean()->get();
}

std::vector<std::string> TomlSection::GetStrings(const std::string& key,
                                                 const std::vector<std::string>& fallback) const {
  const toml::node* node = Find(key);
  if (!node) return fallback;
  if (!node->is_array()) Mismatch(key, "an array of strings");
  std::vector<std::string> out;
  for (const toml::node& item : *node->as_array()) {
    if (!item.is_string())
      throw Error(ErrorCode::kInvalidArgument,
                  Where(key) + " must be an array of strings, found " + TypeName(item) + " inside");
    out.push_back(item.as_string()->get());
  }
  return out;
}

void TomlSection::RejectUnknownKeys(const std::vector<std::string>& known) const {
  if (!table_) return;
  for (const auto& [key, value] : *table_) {
    std::string name(key.str());
    if (std::find(known.begin(), known.end(), name) == known.end()) {
      std::string list;
      for (const auto& k : known) list += (list.empty() ? "" : ", ") + k;
      throw Error(ErrorCode::kInvalidArgument,
                  Where(name) + " is not a known key here (known: " + list + ")");
    }
  }
}

}  // namespace lorastream
