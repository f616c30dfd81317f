// Tokenizer fingerprints of model folders and the records in data files, and the refusal of
// data made for another tokenizer (common/formats/tokenizer_id.h, ValidateJobSpec).
#include "common/formats/tokenizer_id.h"

#include <catch2/catch.hpp>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "common/base/error.h"
#include "common/job/job_spec.h"
#include "tests/support/test_support.h"
#include "tests/tokenizer_fixtures.h"

using namespace lorastream;
using testing::ReadJsonFile;
namespace fs = std::filesystem;

namespace {

void WriteJsonlWithRecord(const fs::path& p, const TokenizerId& id) {
  std::ofstream f(p);
  f << nlohmann::json{{"lorastream_tokenizer",
                       {{"name", id.name},
                        {"fingerprint", id.fingerprint},
                        {"vocab_size", id.vocab_size}}}}
           .dump()
    << "\n{\"input_ids\": [1, 2, 3]}\n";
}

// A token file as common/formats/data.h lays it out: one document [5, 6, 7], u16 ids, no mask, then
// the tokenizer record (flags bit 1).
void WriteTokenFileWithRecord(const fs::path& p, const std::string& record_json) {
  std::ofstream f(p, std::ios::binary);
  auto put = [&](const auto v) { f.write(reinterpret_cast<const char*>(&v), sizeof(v)); };
  f.write("LSTOKEN\0", 8);
  put(uint32_t{1});
  put(uint32_t{2});
  put(uint64_t{1});
  put(uint64_t{3});
  put(uint32_t{2});
  put(uint32_t{0});
  put(uint64_t{0});
  put(uint64_t{3});
  for (uint16_t id : {5, 6, 7}) put(id);
  put(static_cast<uint32_t>(record_json.size()));
  f << record_json;
}

}  // namespace

TEST_CASE("each fixture tokenizer has its own fingerprint and transformers' vocabulary size",
          "[common][tokenizer]") {
  std::set<std::string> seen;
  for (const char* kind : {"llama3", "qwen", "mistral", "llama2"}) {
    INFO(kind);
    std::optional<TokenizerId> id =
        ModelTokenizerId((testing::TokenizerFixtures() / kind).string());
    REQUIRE(id);
    CHECK(id->name == kind);
    CHECK(id->fingerprint.rfind("tok-", 0) == 0);
    CHECK(id->fingerprint.size() == 20);
    CHECK(id->vocab_size ==
          ReadJsonFile(testing::TokenizerFixtures() / kind / "expected.json")["vocab_size"]
              .get<int64_t>());
    CHECK(seen.insert(id->fingerprint).second);
  }
  const testing::TempDir empty("tokid-empty");
  CHECK_FALSE(ModelTokenizerId(empty.str()));
}

TEST_CASE("the fingerprint survives re-saving and changes with what decides the ids",
          "[common][tokenizer]") {
  const testing::TempDir scratch_dir("tokid-resave");
  const fs::path& dir = scratch_dir.path();
  nlohmann::json j = ReadJsonFile(testing::TokenizerFixtures() / "llama3/tokenizer.json");
  const std::string original =
      ModelTokenizerId((testing::TokenizerFixtures() / "llama3").string())->fingerprint;
  std::ofstream(dir / "tokenizer.json") << j.dump(4);  // other whitespace, other key order
  CHECK(ModelTokenizerId(dir.string())->fingerprint == original);
  j["decoder"] = nullptr;  // decoding does not change ids
  std::ofstream(dir / "tokenizer.json") << j.dump();
  CHECK(ModelTokenizerId(dir.string())->fingerprint == original);
  j["post_processor"] = nullptr;  // no BOS any more
  std::ofstream(dir / "tokenizer.json") << j.dump();
  CHECK(ModelTokenizerId(dir.string())->fingerprint != original);
  std::ofstream(dir / "tokenizer.json") << "{not json";
  CHECK_THROWS_AS(ModelTokenizerId(dir.string()), Error);
}

TEST_CASE("data records are read from JSONL and token files; none means hand-made ids",
          "[common][tokenizer]") {
  const testing::TempDir scratch_dir("tokid-records");
  const fs::path& dir = scratch_dir.path();
  TokenizerId id{"llama3", "tok-0123456789abcdef", 700};
  WriteJsonlWithRecord(dir / "a.jsonl", id);
  std::optional<TokenizerId> got = DataTokenizerId((dir / "a.jsonl").string(), "jsonl");
  REQUIRE(got);
  CHECK(got->fingerprint == id.fingerprint);
  CHECK(got->vocab_size == 700);
  CHECK(got->name == "llama3");
  std::ofstream(dir / "plain.jsonl") << "{\"input_ids\": [1, 2, 3]}\n";
  CHECK_FALSE(DataTokenizerId((dir / "plain.jsonl").string(), "jsonl"));

  WriteTokenFileWithRecord(
      dir / "a.tok", R"({"name":"qwen","fingerprint":"tok-fedcba9876543210","vocab_size":532})");
  got = DataTokenizerId((dir / "a.tok").string(), "tokens");
  REQUIRE(got);
  CHECK(got->fingerprint == "tok-fedcba9876543210");
  CHECK(got->vocab_size == 532);
  WriteTokenFileWithRecord(dir / "bad.tok", R"({"name":"qwen"})");
  CHECK_THROWS_WITH(DataTokenizerId((dir / "bad.tok").string(), "tokens"),
                    Catch::Contains("bad.tok") && Catch::Contains("fingerprint"));
}

TEST_CASE("a checkpoint job whose data was prepared for another tokenizer is refused, naming both",
          "[common][tokenizer]") {
  const testing::TempDir scratch_model("tokid-model");
  const fs::path& model = scratch_model.path();
  std::ofstream(model / "config.json")
      << nlohmann::json{{"model_type", "llama"},    {"hidden_size", 64},
                        {"intermediate_size", 128}, {"num_hidden_layers", 2},
                        {"num_attention_heads", 4}, {"num_key_value_heads", 2},
                        {"vocab_size", 768},        {"max_position_embeddings", 512}}
             .dump();
  fs::copy_file(testing::TokenizerFixtures() / "llama3/tokenizer.json", model / "tokenizer.json");
  const TokenizerId llama3 = *ModelTokenizerId(model.string());
  const TokenizerId qwen = *ModelTokenizerId((testing::TokenizerFixtures() / "qwen").string());

  JobSpec spec;
  spec.model.checkpoint = model.string();
  spec.data.format = "jsonl";
  spec.data.seq_len = 64;
  spec.train.steps = 1;
  spec.train.output_dir = (model / "out").string();
  spec.data.path = (model / "qwen.jsonl").string();
  WriteJsonlWithRecord(spec.data.path, qwen);
  std::vector<std::string> problems = ValidateJobSpec(spec);
  REQUIRE(problems.size() == 1);
  CHECK_THAT(problems[0], Catch::Contains("data.path") && Catch::Contains(qwen.fingerprint) &&
                              Catch::Contains(llama3.fingerprint) && Catch::Contains("qwen") &&
                              Catch::Contains("lorastream prepare"));

  spec.data.path = (model / "llama3.jsonl").string();
  WriteJsonlWithRecord(spec.data.path, llama3);
  for (const std::string& p : ValidateJobSpec(spec)) FAIL_CHECK(p);

  spec.data.path = (model / "hand.jsonl").string();  // no record: the loader's vocab check
  std::ofstream(spec.data.path) << "{\"input_ids\": [1, 2, 3]}\n";
  for (const std::string& p : ValidateJobSpec(spec)) FAIL_CHECK(p);

  // A model folder without tokenizer.json: only the vocabulary size can be compared.
  fs::remove(model / "tokenizer.json");
  spec.data.path = (model / "qwen.jsonl").string();
  for (const std::string& p : ValidateJobSpec(spec)) FAIL_CHECK(p);  // 532 <= 768
  TokenizerId big = qwen;
  big.vocab_size = 1000;
  WriteJsonlWithRecord(spec.data.path, big);
  problems = ValidateJobSpec(spec);
  REQUIRE(problems.size() == 1);
  CHECK_THAT(problems[0], Catch::Contains("vocab_size 768"));
}
