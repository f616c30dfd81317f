// Loading human-written TOML files (job specs, presets, options) with errors that name the
// file, the key (dotted path) and what was expected.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <toml++/toml.h>

namespace lorastream {

// What a TOML text may hold before it reaches the parser: toml++ recurses once per level of
// nesting (tables in dotted keys and headers, arrays, inline tables), so a 50,000-level
// `[a.a.a...]` would overflow the stack. The size bounds what is read and allocated; it is
// above what `submit` sends (kMaxJobFileBytes) so that a long value there is refused naming
// its key.
inline constexpr uint64_t kMaxTomlBytes = uint64_t{64} << 20;
inline constexpr int kMaxTomlDepth = 64;

// Throws Error(kCorrupt) naming `source_name`, the line and the limit when `text` is larger
// than kMaxTomlBytes or nests deeper than kMaxTomlDepth; an over-estimate of the depth (a
// scan without parsing), exact for the files lorastream reads. Every TOML text goes through
// this before toml::parse (TomlSection::Parse calls it).
void CheckTomlLimits(const std::string& text, const std::string& source_name);

// A view on one table of a parsed TOML document; remembers the file and the key path so that
// every error says where it happened. Copies are cheap (the document is shared).
class TomlSection {
 public:
  // Parses `path`; throws Error(kNotFound) when missing, Error(kCorrupt) with line/column
  // when the TOML does not parse, and naming the file when it is not a regular file or is
  // above the limits of CheckTomlLimits.
  static TomlSection Load(const std::string& path);
  static TomlSection Parse(const std::string& text, const std::string& source_name);

  bool Has(const std::string& key) const;
  // Sub-table; a missing one is an empty section (all defaults), a non-table is an error.
  TomlSection Section(const std::string& key) const;

  // Typed getters: Require* throw when the key is missing; Get* return `fallback`. Both
  // throw Error(kCorrupt) naming file, key and expected type when the value has another type.
  std::string RequireString(const std::string& key) const;
  std::string GetString(const std::string& key, const std::string& fallback) const;
  int64_t RequireInt(const std::string& key) const;
  int64_t GetInt(const std::string& key, int64_t fallback) const;
  double GetDouble(const std::string& key, double fallback) const;  // ints accepted
  bool GetBool(const std::string& key, bool fallback) const;
  std::vector<std::string> GetStrings(const std::string& key,
                                      const std::vector<std::string>& fallback) const;

  // Throws when the table holds a key not in `known` (catches typos like `ranke = 8`).
  void RejectUnknownKeys(const std::vector<std::string>& known) const;

  // "FILE: key `a.b`" for messages of callers that validate values themselves.
  std::string Where(const std::string& key) const;
  // "a.b": the key's dotted path in the document.
  std::string Path(const std::string& key) const { return prefix_ + key; }
  const std::string& file() const { return *file_; }

 private:
  TomlSection(std::shared_ptr<toml::table> root, const toml::table* table,
              std::shared_ptr<std::string> file, std::string prefix);
  const toml::node* Find(const std::string& key) const;
  [[noreturn]] void Mismatch(const std::string& key, const char* expected) const;

  std::shared_ptr<toml::table> root_;
  const toml::table* table_;
  std::shared_ptr<std::string> file_;
  std::string prefix_;
};

}  // namespace lorastream
