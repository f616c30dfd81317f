// Input a careless user gives, refused naming what is wrong (or shown harmlessly): a NUL byte
// after a JSONL record, a tokenizer record with a negative vocabulary, data whose every token
// is masked, a job name too long for a message, names that would run into the next column or
// reverse a listing; and a statistics file that a resume would repeat steps in.
#include <catch2/catch.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>

#include "common/base/error.h"
#include "common/base/terminal_text.h"
#include "common/formats/data.h"
#include "common/formats/tokenizer_id.h"
#include "common/job/job_data.h"
#include "common/job/job_spec.h"
#include "common/job/step_stats_json.h"
#include "tests/support/test_support.h"

using namespace lorastream;
namespace fs = std::filesystem;

namespace {

void Write(const fs::path& p, const std::string& text) {
  std::ofstream out(p, std::ios::binary);
  out << text;
}

std::string ErrorOf(const std::function<void()>& f, ErrorCode* code = nullptr) {
  try {
    f();
  } catch (const Error& e) {
    if (code) *code = e.code();
    return e.what();
  }
  return "";
}

std::vector<int64_t> StepsIn(const fs::path& p) {
  std::ifstream in(p);
  std::vector<int64_t> steps;
  for (std::string line; std::getline(in, line);)
    steps.push_back(nlohmann::json::parse(line)["step"].get<int64_t>());
  return steps;
}

}  // namespace

TEST_CASE("a NUL byte after a JSONL record is refused naming file, line and column", "[common]") {
  const testing::TempDir dir("nul");
  const fs::path data = dir.path() / "d.jsonl";
  const std::string nul(1, '\0');
  Write(data, "{\"input_ids\": [1, 2, 3]}\n{\"input_ids\": [4, 5]}" + nul + "{\"x\": 1}\n");
  ErrorCode code{};
  const std::string why = ErrorOf([&] { LoadDocuments(data.string(), "jsonl", 100); }, &code);
  CHECK(code == ErrorCode::kCorrupt);
  CHECK_THAT(why, Catch::Contains(data.string() + ":2: a NUL byte at column 22"));

  // The same in the tokenizer record's line.
  Write(data, "{\"lorastream_tokenizer\": {\"fingerprint\": \"f\", \"vocab_size\": 9}}" + nul +
                  "junk\n{\"input_ids\": [1]}\n");
  CHECK_THAT(ErrorOf([&] { DataTokenizerId(data.string(), "jsonl"); }),
             Catch::Contains(data.string() + ":1: a NUL byte"));
}

TEST_CASE("a tokenizer record with vocab_size -1 is refused naming file and line", "[common]") {
  const testing::TempDir dir("vocab");
  const fs::path data = dir.path() / "d.jsonl";
  Write(data,
        "\n{\"lorastream_tokenizer\": {\"name\": \"t\", \"fingerprint\": \"f\", \"vocab_size\": "
        "-1}}\n"
        "{\"input_ids\": [1, 2]}\n");
  ErrorCode code{};
  const std::string why = ErrorOf([&] { DataTokenizerId(data.string(), "jsonl"); }, &code);
  CHECK(code == ErrorCode::kCorrupt);
  CHECK_THAT(why, Catch::Contains(data.string() + ":2: the tokenizer record's `vocab_size` must be "
                                                  "> 0 (found -1)"));
  // What the worker and `submit` ask before a job runs says the same.
  CHECK_THAT(DataTokenizerProblem(
                 data.string(), "jsonl", [] { return std::optional<TokenizerId>(); }, "store", 100),
             Catch::Contains("(found -1)"));
}

TEST_CASE("data whose every trained token is masked is refused", "[common]") {
  const testing::TempDir dir("masked");
  const fs::path data = dir.path() / "d.jsonl";
  // Only the first token of each document is unmasked: it is never a target (the loss predicts
  // token s + 1 from token s), so nothing would be trained.
  Write(data,
        "{\"input_ids\": [1, 2, 3, 4], \"labels\": [1, -100, -100, -100]}\n"
        "{\"input_ids\": [5, 6, 7, 8], \"loss_mask\": [1, 0, 0, 0]}\n");
  JobSpec spec;
  spec.data.path = data.string();
  spec.data.format = "jsonl";
  spec.data.seq_len = 4;
  spec.data.packing = false;
  spec.train.steps = 3;
  ErrorCode code{};
  const std::string why = ErrorOf([&] { LoadJobData(spec, 100); }, &code);
  CHECK(code == ErrorCode::kRefused);
  CHECK_THAT(why, Catch::Contains("data.path " + data.string() + ": no token to train on"));
  CHECK_THAT(why, Catch::Contains("2 sequences"));

  // One target is enough.
  Write(data, "{\"input_ids\": [1, 2, 3, 4], \"labels\": [-100, -100, 3, -100]}\n");
  CHECK(LoadJobData(spec, 100).train.count == 1);
}

TEST_CASE("a job name over the limit is refused naming the limit", "[common]") {
  JobSpec spec;
  spec.source = "/jobs/long.toml";
  spec.name = std::string(kMaxJobNameBytes, 'n');
  CHECK(JobNameProblem(spec).empty());
  spec.name = std::string(10 << 20, 'n');
  const std::string why = JobNameProblem(spec);
  CHECK(why == "/jobs/long.toml: key `name` is 10485760 bytes long, above the limit of " +
                   std::to_string(kMaxJobNameBytes) + " bytes");
  const std::vector<std::string> problems = ValidateJobSpec(spec);
  CHECK(std::find(problems.begin(), problems.end(), why) != problems.end());
}

TEST_CASE("bidi controls are escaped and table cells keep their width", "[common]") {
  CHECK(TerminalSafe("evil\xe2\x80\xae"
                     "txt.exe") == "evil\\u202etxt.exe");
  CHECK(TerminalSafe("\xe2\x81\xa6x\xe2\x81\xa9\xe2\x80\x8f") == "\\u2066x\\u2069\\u200f");
  CHECK(TerminalSafe("caf\xc3\xa9 \xe2\x80\x94 ok") == "caf\xc3\xa9 \xe2\x80\x94 ok");

  CHECK(TerminalColumn("short", 8) == "short   ");
  CHECK(TerminalColumn("exactly", 8) == "exactly ");
  CHECK(TerminalColumn("exactly8", 8) == "exactl\xe2\x80\xa6 ");
  CHECK(TerminalColumn("a-name-of-twenty-chars", 10) == "a-name-o\xe2\x80\xa6 ");
  // Width in characters, not bytes: é is one character.
  CHECK(TerminalColumn("\xc3\xa9t\xc3\xa9", 5) == "\xc3\xa9t\xc3\xa9  ");
  CHECK(TerminalColumn("\xe2\x80\xae", 10) == "\\u202e    ");
}

TEST_CASE("a resume drops the statistics an interrupted run wrote after its checkpoint",
          "[common]") {
  const testing::TempDir dir("stats");
  const fs::path stats = dir.path() / "stats.jsonl";
  DropStatsAfter(stats.string(), 4);  // none yet: nothing to do
  CHECK_FALSE(fs::exists(stats));
  std::string lines;
  for (int64_t step = 1; step <= 6; ++step) {
    StepStats s;
    s.step = step;
    lines += StepStatsJson(s) + "\n";
  }
  Write(stats, lines);
  DropStatsAfter(stats.string(), 6);
  CHECK(StepsIn(stats) == std::vector<int64_t>{1, 2, 3, 4, 5, 6});
  DropStatsAfter(stats.string(), 4);
  CHECK(StepsIn(stats) == std::vector<int64_t>{1, 2, 3, 4});
  DropStatsAfter(stats.string(), 0);
  CHECK(StepsIn(stats).empty());
}
