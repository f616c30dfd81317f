// Text from users (job names, reasons, paths, job files) printed to a terminal or a log:
// control characters are escaped, so an escape sequence in a job name cannot move the
// cursor, recolour or retitle the operator's terminal.
#pragma once

#include <string>
#include <string_view>

namespace lorastream {

// C0 controls and DEL become \xNN (\n and \t too unless keep_newlines), C1 controls
// (U+0080-U+009F) and bidirectional formatting characters (U+202A-U+202E, U+2066-U+2069,
// U+200E, U+200F, U+061C) become \uNNNN, bytes that are not valid UTF-8 become \xNN; everything
// else, valid UTF-8 included, is unchanged. With keep_newlines, '\n' stays (multi-line text).
std::string TerminalSafe(std::string_view text, bool keep_newlines = false);

// A table cell: `text` made TerminalSafe and fitted to `width` characters (code points), so
// that the next column starts where the header says: padded with spaces, or cut to
// width - 2 characters, an ellipsis and a space.
std::string TerminalColumn(std::string_view text, size_t width);

}  // namespace lorastream
