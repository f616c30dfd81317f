#include "common/toml_file.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "common/error.h"

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

TomlSection::TomlSection(std::shared_ptr<toml::table> root, const toml::table* table,
                         std::shared_ptr<std::string> file, std::string prefix)
    : root_(std::move(root)), table_(table), file_(std::move(file)), prefix_(std::move(prefix)) {}

TomlSection TomlSection::Parse(const std::string& text, const std::string& source_name) {
  // toml++ is built with exceptions here: parse() throws toml::parse_error.
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
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec))
    throw Error(ErrorCode::kNotFound, path + ": no such file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(ErrorCode::kIo, path + ": cannot open");
  std::stringstream buffer;
  buffer << in.rdbuf();
  return Parse(buffer.str(), path);
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
