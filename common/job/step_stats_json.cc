#include "common/job/step_stats_json.h"

#include <filesystem>
#include <fstream>

#include "common/base/error.h"
#include "common/posix/durable_file.h"

namespace lorastream {

nlohmann::json StepStatsToJson(const StepStats& s) {
  nlohmann::json j = {{"step", s.step},
                      {"total_steps", s.total_steps},
                      {"loss", s.loss},
                      {"learning_rate", s.learning_rate},
                      {"grad_norm", s.grad_norm},
                      {"tokens", s.tokens},
                      {"step_seconds", s.step_seconds},
                      {"tokens_per_second", s.tokens_per_second},
                      {"h2d_bytes", s.h2d_bytes},
                      {"h2d_busy_seconds", s.h2d_busy_seconds},
                      {"stall_seconds", s.stall_seconds},
                      {"copies", s.copies},
                      {"copies_saved", s.copies_saved},
                      {"peak_device_bytes", s.peak_device_bytes}};
  // Only the steps that ran an evaluation carry it (JSON has no NaN).
  if (s.has_eval()) {
    j["eval_loss"] = s.eval_loss;
    j["eval_tokens"] = s.eval_tokens;
  }
  return j;
}

std::string StepStatsJson(const StepStats& s) { return StepStatsToJson(s).dump(); }

void DropStatsAfter(const std::string& path, int64_t step) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) return;  // none yet, or a device (/dev/null)
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(ErrorCode::kIo, "train.stats_file: cannot read " + path);
  std::string kept, line;
  bool dropped = false;
  while (std::getline(in, line)) {
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_object() && j.contains("step") && j["step"].is_number_integer() &&
        j["step"].get<int64_t>() > step) {
      dropped = true;
      continue;
    }
    kept += line + "\n";
  }
  if (in.bad()) throw Error(ErrorCode::kIo, "train.stats_file: cannot read " + path);
  if (dropped) WriteFileDurably(path, kept);
}

}  // namespace lorastream
