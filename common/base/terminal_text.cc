#include "common/base/terminal_text.h"

#include <cstdint>
#include <cstdio>
#include <vector>

namespace lorastream {

namespace {

// Length of the valid UTF-8 sequence starting at s[i] (0 when invalid); *cp its code point.
size_t Utf8Sequence(std::string_view s, size_t i, uint32_t* cp) {
  const auto b = [&](size_t k) { return static_cast<uint8_t>(s[i + k]); };
  const uint8_t c = b(0);
  size_t n = 0;
  uint32_t v = 0, min = 0;
  if (c >= 0xC2 && c <= 0xDF)
    n = 2, v = c & 0x1F, min = 0x80;
  else if (c >= 0xE0 && c <= 0xEF)
    n = 3, v = c & 0x0F, min = 0x800;
  else if (c >= 0xF0 && c <= 0xF4)
    n = 4, v = c & 0x07, min = 0x10000;
  else
    return 0;
  if (i + n > s.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    if ((b(k) & 0xC0) != 0x80) return 0;
    v = (v << 6) | (b(k) & 0x3F);
  }
  if (v < min || v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) return 0;
  *cp = v;
  return n;
}

// Unicode's bidirectional formatting characters: U+202E (RIGHT-TO-LEFT OVERRIDE) in a job name
// makes a terminal draw the rest of the line backwards, so a listing would show another name.
bool IsBidiControl(uint32_t cp) {
  return cp == 0x061C || cp == 0x200E || cp == 0x200F || (cp >= 0x202A && cp <= 0x202E) ||
         (cp >= 0x2066 && cp <= 0x2069);
}

}  // namespace

std::string TerminalSafe(std::string_view text, bool keep_newlines) {
  std::string out;
  out.reserve(text.size());
  char buf[12];
  for (size_t i = 0; i < text.size();) {
    const uint8_t c = static_cast<uint8_t>(text[i]);
    if (c < 0x80) {
      if ((c < 0x20 && !(keep_newlines && c == '\n')) || c == 0x7F) {
        std::snprintf(buf, sizeof buf, "\\x%02x", c);
        out += buf;
      } else {
        out += static_cast<char>(c);
      }
      ++i;
      continue;
    }
    uint32_t cp = 0;
    const size_t n = Utf8Sequence(text, i, &cp);
    if (n == 0) {
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
      ++i;
    } else if (cp <= 0x9F || IsBidiControl(cp)) {
      std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(cp));
      out += buf;
      i += n;
    } else {
      out.append(text.substr(i, n));
      i += n;
    }
  }
  return out;
}

std::string TerminalColumn(std::string_view text, size_t width) {
  const std::string safe = TerminalSafe(text);
  // Characters (code points: TerminalSafe leaves only valid UTF-8) and where each starts.
  std::vector<size_t> starts;
  for (size_t i = 0; i < safe.size(); ++i)
    if ((static_cast<uint8_t>(safe[i]) & 0xC0) != 0x80) starts.push_back(i);
  if (width < 2) return std::string(width, ' ');
  if (starts.size() < width) return safe + std::string(width - starts.size(), ' ');
  return safe.substr(0, starts[width - 2]) + "\u2026 ";
}

}  // namespace lorastream
