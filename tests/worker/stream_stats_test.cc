// Step statistics as JSON lines and progress-line text.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "worker/stream/stream_stats.h"

using namespace lorastream;
using namespace lorastream::worker;

TEST_CASE("StepStatsJson writes every field on one line", "[worker]") {
  StepStats s;
  s.step = 3;
  s.total_steps = 10;
  s.loss = 2.5;
  s.h2d_bytes = 8383426560ULL;
  s.h2d_busy_seconds = 0.152;
  s.stall_seconds = 0.0013;
  s.copies = 20;
  s.copies_saved = 4;
  s.peak_device_bytes = 1ULL << 34;
  const std::string line = StepStatsJson(s);
  REQUIRE(line.find('\n') == std::string::npos);
  const nlohmann::json j = nlohmann::json::parse(line);
  REQUIRE(j.at("step") == 3);
  REQUIRE(j.at("loss") == 2.5);
  REQUIRE(j.at("h2d_bytes").get<uint64_t>() == 8383426560ULL);
  REQUIRE(j.at("copies") == 20);
  REQUIRE(j.at("copies_saved") == 4);
  REQUIRE(j.at("peak_device_bytes").get<uint64_t>() == (1ULL << 34));
  for (const char* key : {"total_steps", "learning_rate", "grad_norm", "tokens", "step_seconds",
                          "tokens_per_second", "h2d_busy_seconds", "stall_seconds"}) {
    REQUIRE(j.contains(key));
  }
  const std::string text = FormatStreamStats(s);
  REQUIRE(text.find("h2d 8.38 GB") != std::string::npos);
  REQUIRE(text.find("stall 1.3 ms") != std::string::npos);
  REQUIRE(text.find("copies 20 saved 4") != std::string::npos);
  REQUIRE(text.find("peak 16.00 GiB") != std::string::npos);
}
