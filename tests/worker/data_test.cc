#include "common/formats/data.h"

#include <catch2/catch.hpp>

#include <fstream>
#include <set>

#include <nlohmann/json.hpp>

#include "common/base/error.h"
#include "common/posix/subprocess.h"
#include "worker_test_util.h"

using namespace lorastream;

TEST_CASE("JSONL: labels, loss_mask and refusals naming file and line", "[worker]") {
  testing::TempDir dir("data");
  {
    std::ofstream f(dir / "a.jsonl");
    f << "{\"input_ids\": [1, 2, 3]}\n\n"
      << "{\"input_ids\": [4, 5, 6], \"labels\": [-100, 5, 6]}\n"
      << "{\"input_ids\": [7, 8], \"loss_mask\": [0, 1]}\n";
  }
  auto docs = LoadDocuments(dir / "a.jsonl", "jsonl", 10);
  REQUIRE(docs.size() == 3);
  CHECK(docs[0].labels == std::vector<int32_t>{1, 2, 3});
  CHECK(docs[1].labels == std::vector<int32_t>{-100, 5, 6});
  CHECK(docs[2].labels == std::vector<int32_t>{-100, 8});
  try {
    LoadDocuments(dir / "a.jsonl", "jsonl", 8);  // 8 is out of a vocabulary of 8
    FAIL("accepted");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kRefused);
    CHECK(std::string(e.what()).find("a.jsonl:4") != std::string::npos);
  }
  {
    std::ofstream f(dir / "b.jsonl");
    f << "{\"input_ids\": [1, 2]}\n{\"input_ids\": [1, \"x\"]}\n";
  }
  try {
    LoadDocuments(dir / "b.jsonl", "jsonl", 10);
    FAIL("accepted");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("b.jsonl:2") != std::string::npos);
  }
  CHECK_THROWS_AS(LoadDocuments(dir / "none.jsonl", "jsonl", 10), Error);
}

TEST_CASE("token files round-trip and malformed ones are refused", "[worker]") {
  testing::TempDir dir("tok");
  std::vector<Document> docs = {{{1, 2, 3}, {1, 2, 3}}, {{300, 4}, {-100, 4}}, {{5}, {5}}};
  WriteTokenFile(dir / "d.tok", docs, 2, true);
  auto back = LoadDocuments(dir / "d.tok", "tokens", 1000);
  REQUIRE(back.size() == 3);
  CHECK(back[1].ids == std::vector<int32_t>{300, 4});
  CHECK(back[1].labels == std::vector<int32_t>{-100, 4});
  WriteTokenFile(dir / "e.tok", docs, 4, false);
  CHECK(LoadDocuments(dir / "e.tok", "tokens", 1000)[1].labels == std::vector<int32_t>{300, 4});
  try {
    LoadDocuments(dir / "d.tok", "tokens", 100);
    FAIL("accepted");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kRefused);
    CHECK(std::string(e.what()).find("document 1") != std::string::npos);
  }
  std::string bytes = testing::ReadFile(dir / "d.tok");
  for (size_t cut : {size_t{3}, size_t{41}, bytes.size() - 1}) {
    std::ofstream(dir / "t.tok", std::ios::binary)
        .write(bytes.data(), static_cast<std::streamsize>(cut));
    CHECK_THROWS_AS(LoadDocuments(dir / "t.tok", "tokens", 1000), Error);
  }
}

TEST_CASE("packing, padding, shifted targets and the seeded order", "[worker]") {
  std::vector<Document> docs = {{{1, 2, 3, 4, 5}, {1, 2, 3, 4, 5}}, {{6, 7}, {-100, 7}}};
  SequenceSet packed = BuildSequences(docs, 4, true, 0);
  CHECK(packed.count == 2);
  CHECK(packed.ids == std::vector<int32_t>{1, 2, 3, 4, 5, 6, 7, 0});
  CHECK(packed.labels == std::vector<int32_t>{1, 2, 3, 4, 5, -100, 7, -100});
  SequenceSet padded = BuildSequences(docs, 4, false, 9);
  CHECK(padded.ids == std::vector<int32_t>{1, 2, 3, 4, 6, 7, 9, 9});
  Sampler sampler(2, 1);
  Batch b = MakeBatch(padded, sampler, 0, 2);
  // Whichever order: each row's targets are its labels shifted by one.
  for (int r = 0; r < 2; ++r) {
    CHECK(b.targets[r * 4 + 3] == -100);
    if (b.ids[r * 4] == 1)
      CHECK(std::vector<int64_t>(b.targets.begin() + r * 4, b.targets.begin() + r * 4 + 3) ==
            std::vector<int64_t>{2, 3, 4});
  }
  Sampler s1(100, 42), s2(100, 42), s3(100, 43);
  std::set<int64_t> epoch;
  bool differs = false;
  for (int64_t p = 0; p < 100; ++p) {
    const int64_t i = s1.Index(p);
    CHECK(i == s2.Index(p));
    differs |= i != s3.Index(p);
    epoch.insert(i);
  }
  CHECK(epoch.size() == 100);  // a permutation per epoch
  CHECK(differs);
}

TEST_CASE("data written by `lorastream prepare` loads with its tokenizer record skipped",
          "[worker][prepare]") {
  if (!testing::HaveNode()) {
    WARN("no Node.js here (tools/setup.sh installs it): `lorastream prepare` not tested");
    return;
  }
  // tools/prepare/prepare.mjs writes both formats; the ids and masks must come back as
  // transformers made them (tests/fixtures/tokenizers/mistral/expected.json).
  testing::TempDir dir("prepared");
  const std::string source = LORASTREAM_SOURCE_DIR;
  const std::string model = source + "/tests/fixtures/tokenizers/mistral";
  nlohmann::json expected;
  std::ifstream(model + "/expected.json") >> expected;
  const nlohmann::json& chats = expected["formats"]["messages"];
  {
    std::ofstream f(dir / "chats.jsonl");
    for (const auto& r : chats["records"]) f << r.dump() << "\n";
  }
  for (const std::string out : {"d.tok", "d.jsonl"}) {
    INFO(out);
    int code = -1;
    RunAndCapture({"node", source + "/tools/prepare/prepare.mjs", "--model", model, "--in",
                   dir / "chats.jsonl", "--format", "messages", "--out", dir / out, "--fingerprint",
                   "tok-0000000000000001"},
                  &code);
    REQUIRE(code == 0);
    auto docs = LoadDocuments(dir / out, out.size() > 5 ? "jsonl" : "tokens",
                              expected["vocab_size"].get<int64_t>());
    REQUIRE(docs.size() == chats["expected"].size());
    for (size_t i = 0; i < docs.size(); ++i) {
      CHECK(nlohmann::json(docs[i].ids) == chats["expected"][i]["input_ids"]);
      CHECK(nlohmann::json(docs[i].labels) == chats["expected"][i]["labels"]);
    }
  }
}
