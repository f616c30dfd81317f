// `lorastream prepare` through its C++ side (coordinator/cli/prepare.h), which runs
// tools/prepare/prepare.mjs under node: the written data holds transformers' ids and masks
// (tests/fixtures/tokenizers/) and the model folder's tokenizer fingerprint.
#include "coordinator/cli/prepare.h"

#include <catch2/catch.hpp>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/base/error.h"
#include "common/formats/tokenizer_id.h"
#include "tests/support/test_support.h"
#include "tests/tokenizer_fixtures.h"

using namespace lorastream;
using namespace lorastream::cli;
using testing::ReadJsonFile;
namespace fs = std::filesystem;
using Json = nlohmann::json;

namespace {

std::vector<Json> ReadLines(const fs::path& p) {
  std::ifstream in(p);
  std::vector<Json> out;
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) out.push_back(Json::parse(line));
  return out;
}

std::string ReadText(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

fs::path WriteRecords(const fs::path& dir, const std::string& name, const Json& records) {
  std::ofstream f(dir / name);
  for (const Json& r : records) f << r.dump() << "\n";
  return dir / name;
}

}  // namespace

TEST_CASE("prepare writes transformers' ids and assistant masks for every tokenizer and format",
          "[coordinator][prepare]") {
  if (!testing::HaveNode()) {
    WARN("no Node.js here (tools/setup.sh installs it): `lorastream prepare` not tested");
    return;
  }
  const testing::TempDir scratch_dir("prepare-formats");
  const fs::path& dir = scratch_dir.path();
  for (const char* kind : {"llama3", "qwen", "mistral", "llama2"}) {
    const Json expected = ReadJsonFile(testing::TokenizerFixtures() / kind / "expected.json");
    const TokenizerId tokenizer = *ModelTokenizerId((testing::TokenizerFixtures() / kind).string());
    for (const auto& [format, c] : expected["formats"].items()) {
      INFO(kind << " --format " << format);
      PrepareOptions o;
      o.model_dir = (testing::TokenizerFixtures() / kind).string();
      o.inputs = {WriteRecords(dir, format + ".jsonl", c["records"]).string()};
      o.format = format;
      o.out = (dir / (std::string(kind) + "-" + format + ".jsonl")).string();
      REQUIRE(RunPrepare(o) == 0);
      const std::vector<Json> lines = ReadLines(o.out);
      REQUIRE(lines.size() == c["expected"].size() + 1);
      CHECK(lines[0]["lorastream_tokenizer"]["fingerprint"] == tokenizer.fingerprint);
      CHECK(lines[0]["lorastream_tokenizer"]["vocab_size"] == tokenizer.vocab_size);
      CHECK(lines[0]["lorastream_tokenizer"]["name"] == kind);
      for (size_t i = 0; i < c["expected"].size(); ++i) {
        const Json& want = c["expected"][i];
        CHECK(lines[i + 1]["input_ids"] == want["input_ids"]);
        // labels are written only when some token is masked
        CHECK(lines[i + 1].value("labels", lines[i + 1]["input_ids"]) == want["labels"]);
      }
    }
  }
}

TEST_CASE("prepare splits off validation data and writes token files with the record",
          "[coordinator][prepare]") {
  if (!testing::HaveNode()) {
    WARN("no Node.js here (tools/setup.sh installs it): `lorastream prepare` not tested");
    return;
  }
  const testing::TempDir scratch_dir("prepare-split");
  const fs::path& dir = scratch_dir.path();
  const Json expected = ReadJsonFile(testing::TokenizerFixtures() / "mistral/expected.json");
  PrepareOptions o;
  o.model_dir = (testing::TokenizerFixtures() / "mistral").string();
  o.inputs = {WriteRecords(dir, "text.jsonl", expected["formats"]["text"]["records"]).string()};
  o.format = "text";
  o.out = (dir / "train.tok").string();
  o.val_split = 0.2;
  o.seq_len = 8;
  o.seed = 3;
  REQUIRE(RunPrepare(o) == 0);
  REQUIRE(fs::exists(dir / "train.val.tok"));
  const std::string fingerprint = ModelTokenizerId(o.model_dir)->fingerprint;
  CHECK(DataTokenizerId(o.out, "tokens")->fingerprint == fingerprint);
  CHECK(DataTokenizerId((dir / "train.val.tok").string(), "tokens")->fingerprint == fingerprint);
  // 11 documents: round(2.2) = 2 held out. Each file: 40-byte header, offsets, u16 ids (at
  // most 8 per document after truncation), no mask (text trains every token), the record.
  auto docs = [](const fs::path& p) {
    std::ifstream in(p, std::ios::binary);
    uint64_t n = 0;
    in.seekg(16);
    in.read(reinterpret_cast<char*>(&n), 8);
    return n;
  };
  CHECK(docs(o.out) == 9);
  CHECK(docs(dir / "train.val.tok") == 2);
}

TEST_CASE("prepare refuses a model folder without tokenizer.json and bad records clearly",
          "[coordinator][prepare]") {
  if (!testing::HaveNode()) {
    WARN("no Node.js here (tools/setup.sh installs it): `lorastream prepare` not tested");
    return;
  }
  const testing::TempDir scratch_dir("prepare-refusals");
  const fs::path& dir = scratch_dir.path();
  PrepareOptions o;
  o.model_dir = dir.string();
  o.inputs = {
      WriteRecords(dir, "chats.jsonl", Json::array({{{"messages", Json::array()}}})).string()};
  o.format = "messages";
  o.out = (dir / "out.jsonl").string();
  try {
    RunPrepare(o);
    FAIL("a folder without tokenizer.json was accepted");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kNotFound);
    CHECK_THAT(e.what(), Catch::Contains("tokenizer.json"));
  }
  o.model_dir = (testing::TokenizerFixtures() / "qwen").string();
  CHECK(RunPrepare(o) == 4);  // an empty conversation: corrupt input, exit status 4
  o.inputs = {WriteRecords(dir, "roles.jsonl",
                           Json::array({{{"messages", {{{"role", "wizard"}, {"content", "x"}}}}}}))
                  .string()};
  CHECK(RunPrepare(o) == 4);
  CHECK_FALSE(fs::exists(o.out));
}

TEST_CASE("prepare keeps an --out that exists or is an input unless --force",
          "[coordinator][prepare]") {
  if (!testing::HaveNode()) {
    WARN("no Node.js here (tools/setup.sh installs it): `lorastream prepare` not tested");
    return;
  }
  const testing::TempDir scratch_dir("prepare-force");
  const fs::path& dir = scratch_dir.path();
  PrepareOptions o;
  o.model_dir = (testing::TokenizerFixtures() / "qwen").string();
  o.inputs = {WriteRecords(dir, "in.jsonl", Json::array({{{"text", "keep me"}}})).string()};
  o.format = "text";
  o.out = o.inputs[0];
  const std::string before = ReadText(o.out);
  CHECK(RunPrepare(o) == 2);  // its own input: refused, the text kept
  CHECK(ReadText(o.out) == before);
  o.out = (dir / "data.jsonl").string();
  std::ofstream(o.out) << "older\n";
  CHECK(RunPrepare(o) == 2);
  CHECK(ReadText(o.out) == "older\n");
  o.force = true;
  CHECK(RunPrepare(o) == 0);
  CHECK(ReadLines(o.out).size() == 2);
}

TEST_CASE("prepare says so when node itself dies, rather than passing its status on",
          "[coordinator][prepare]") {
  const testing::TempDir scratch_dir("prepare-node-dies");
  const fs::path& dir = scratch_dir.path();
  // A node that ends as V8 does on a fatal error (SIGTRAP: exit status 133 in a shell).
  const fs::path node = dir / "node";
  std::ofstream(node) << "#!/bin/sh\nkill -TRAP $$\n";
  fs::permissions(node, fs::perms::owner_all);
  ::setenv("LORASTREAM_NODE", node.c_str(), 1);
  PrepareOptions o;
  o.model_dir = (testing::TokenizerFixtures() / "qwen").string();
  o.inputs = {WriteRecords(dir, "in.jsonl", Json::array({{{"text", "x"}}})).string()};
  o.format = "text";
  o.out = (dir / "data.jsonl").string();
  std::string what;
  try {
    RunPrepare(o);
  } catch (const Error& e) {
    what = e.what();
  }
  ::unsetenv("LORASTREAM_NODE");
  CHECK_THAT(what, Catch::Contains("node (" + node.string() +
                                   ") ended by signal 5 while "
                                   "tokenizing " +
                                   o.inputs[0]));
}
