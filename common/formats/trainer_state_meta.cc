#include "common/formats/trainer_state_meta.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "common/base/error.h"

namespace lorastream {

namespace {

// Plain decimal digits only (no sign, no spaces, no hex), at most `max`.
bool ParseDecimal(const std::string& text, uint64_t max, uint64_t* out) {
  if (text.empty() || text.size() > 20) return false;
  uint64_t v = 0;
  for (char c : text) {
    if (c < '0' || c > '9') return false;
    const uint64_t digit = static_cast<uint64_t>(c - '0');
    if (v > (max - digit) / 10) return false;
    v = v * 10 + digit;
  }
  *out = v;
  return true;
}

}  // namespace

std::map<std::string, std::string> TrainerStateMetadata(const TrainerStateMeta& m) {
  char loss[64] = "nan";
  if (std::isfinite(m.eval_loss)) std::snprintf(loss, sizeof loss, "%.17g", m.eval_loss);
  return {{"format", "lorastream-trainer-state"},
          {"version", "1"},
          {"step", std::to_string(m.step)},
          {"samples_seen", std::to_string(m.samples_seen)},
          {"seed", std::to_string(m.seed)},
          {"fingerprint", m.fingerprint},
          {"eval_loss", loss}};
}

TrainerStateMeta ParseTrainerStateMetadata(const std::map<std::string, std::string>& meta,
                                           const std::string& source) {
  auto field = [&](const char* key) -> const std::string& {
    auto it = meta.find(key);
    if (it == meta.end())
      throw Error(ErrorCode::kCorrupt, source + ": metadata `" + key + "` is missing");
    return it->second;
  };
  if (field("format") != "lorastream-trainer-state" || field("version") != "1")
    throw Error(ErrorCode::kCorrupt, source + ": not a version 1 lorastream trainer state");
  auto number = [&](const char* key, uint64_t max) {
    uint64_t v = 0;
    if (!ParseDecimal(field(key), max, &v))
      throw Error(ErrorCode::kCorrupt, source + ": metadata `" + key +
                                           "` is not a decimal integer in [0, " +
                                           std::to_string(max) + "]");
    return v;
  };
  constexpr uint64_t kInt64Max = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  TrainerStateMeta m;
  m.step = static_cast<int64_t>(number("step", kInt64Max));
  m.samples_seen = static_cast<int64_t>(number("samples_seen", kInt64Max));
  m.seed = number("seed", std::numeric_limits<uint64_t>::max());
  m.fingerprint = field("fingerprint");
  auto loss = meta.find("eval_loss");
  if (loss != meta.end() && loss->second != "nan") {
    const char* begin = loss->second.c_str();
    char* end = nullptr;
    const double v = loss->second.empty() ? -1.0 : std::strtod(begin, &end);
    if (loss->second.empty() || end != begin + loss->second.size() || !std::isfinite(v) || v < 0)
      throw Error(ErrorCode::kCorrupt, source +
                                           ": metadata `eval_loss` must be \"nan\" or a "
                                           "finite number >= 0 (found \"" +
                                           loss->second + "\")");
    m.eval_loss = v;
  }
  return m;
}

}  // namespace lorastream
