#include "common/formats/manifest.h"

#include <functional>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "common/base/error.h"

using namespace lorastream;

namespace {

Manifest Sample() {
  Manifest m;
  m.store_name = "llama";
  m.generation = 0xfedcba9876543210ull;
  m.fingerprint = "00fc0fa84a7094c9";
  m.config.model_type = "llama";
  m.config.hidden_size = 8;
  m.config.intermediate_size = 16;
  m.config.num_hidden_layers = 1;
  m.config.num_attention_heads = 2;
  m.config.num_key_value_heads = 1;
  m.config.head_dim = 4;
  m.config.vocab_size = 10;
  m.config.max_position_embeddings = 64;
  m.dtype = DType::kBF16;
  SegmentInfo block;
  block.shm_name = "/lorastream.llama.fedcba9876543210.block.0000";
  block.checksum = 0xffffffffffffffffull;  // > 2^53: must survive JSON exactly
  block.tensors = {{"input_layernorm.weight", DType::kBF16, {8}, 0, 16, {}},
                   {"self_attn.q_proj.weight", DType::kBF16, {8, 8}, 256, 128, {}}};
  block.nbytes = 384;
  m.blocks = {block};
  m.rest.shm_name = "/lorastream.llama.fedcba9876543210.rest";
  m.rest.tensors = {{"model.norm.weight", DType::kBF16, {8}, 0, 16, {}}};
  m.rest.nbytes = 16;
  m.owner_pid = 1234;
  m.owner_start_time = 99;
  m.source_dir = "/models/llama";
  return m;
}

std::string ParseFailure(const std::string& text) {
  try {
    ManifestFromJson(text, "/lorastream.x.manifest");
  } catch (const lorastream::Error& e) {
    CHECK(e.code() == ErrorCode::kCorrupt);
    return e.what();
  }
  return "(accepted)";
}

}  // namespace

TEST_CASE("manifest JSON round trip keeps every field exactly", "[common]") {
  const Manifest m = Sample();
  const Manifest r = ManifestFromJson(ManifestToJson(m), "test");
  CHECK(r.store_name == m.store_name);
  CHECK(r.generation == m.generation);
  CHECK(r.fingerprint == m.fingerprint);
  CHECK(r.config.hidden_size == 8);
  CHECK(r.config.head_dim == 4);
  CHECK(r.dtype == DType::kBF16);
  CHECK(r.alignment == 256);
  REQUIRE(r.blocks.size() == 1);
  CHECK(r.blocks[0].checksum == 0xffffffffffffffffull);
  CHECK(r.blocks[0].shm_name == m.blocks[0].shm_name);
  CHECK(r.blocks[0].Find("self_attn.q_proj.weight")->offset == 256);
  CHECK(r.blocks[0].Find("self_attn.q_proj.weight")->shape == std::vector<int64_t>{8, 8});
  CHECK(r.blocks[0].Find("nope") == nullptr);
  CHECK(r.rest.tensors[0].name == "model.norm.weight");
  CHECK(r.owner_pid == 1234);
  CHECK(r.owner_start_time == 99);
  CHECK(r.source_dir == "/models/llama");
  CHECK(r.total_bytes() == 400);
  CHECK(r.tokenizer.fingerprint.empty());  // a folder without tokenizer.json records none
}

TEST_CASE("the manifest keeps the model folder's tokenizer", "[common][tokenizer]") {
  Manifest m = Sample();
  m.tokenizer = {"Llama-3.1-8B", "tok-0123456789abcdef", 128256};
  const Manifest r = ManifestFromJson(ManifestToJson(m), "test");
  CHECK(r.tokenizer.name == "Llama-3.1-8B");
  CHECK(r.tokenizer.fingerprint == "tok-0123456789abcdef");
  CHECK(r.tokenizer.vocab_size == 128256);
}

TEST_CASE("a damaged manifest is refused naming the field", "[common]") {
  const nlohmann::json good = nlohmann::json::parse(ManifestToJson(Sample()));
  auto with = [&](const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json j = good;
    edit(j);
    return ParseFailure(j.dump());
  };
  CHECK_THAT(ParseFailure("{"), Catch::Contains("manifest is not valid JSON"));
  CHECK_THAT(with([](auto& j) { j["format"] = "v0"; }), Catch::Contains("unknown `format`"));
  CHECK_THAT(with([](auto& j) { j["generation"] = "xyz"; }),
             Catch::Contains("`generation` must be a hex string"));
  CHECK_THAT(with([](auto& j) { j["blocks"][0]["tensors"][1]["offset"] = 100; }),
             Catch::Contains("block 0: tensor `self_attn.q_proj.weight`: `offset` is not aligned"));
  CHECK_THAT(with([](auto& j) { j["blocks"][0]["tensors"][1]["nbytes"] = 4; }),
             Catch::Contains("`nbytes` does not match its shape and dtype"));
  CHECK_THAT(with([](auto& j) { j["blocks"][0]["nbytes"] = 300; }),
             Catch::Contains("lies outside its segment"));
  CHECK_THAT(with([](auto& j) { j["blocks"][0]["shm_name"] = "../etc/passwd"; }),
             Catch::Contains("`shm_name` must be `/name`"));
  CHECK_THAT(with([](auto& j) { j["blocks"] = nlohmann::json::array(); }),
             Catch::Contains("has 0 blocks but the config has 1 layers"));
  CHECK_THAT(with([](auto& j) { j["rest"]["tensors"][0]["dtype"] = "Q4"; }),
             Catch::Contains("`dtype` is not a known dtype"));
  CHECK_THAT(with([](auto& j) { j.erase("owner_pid"); }),
             Catch::Contains("`owner_pid` is missing"));
}

TEST_CASE("LayoutSegment: canonical order, aligned offsets, no gap beyond the alignment",
          "[common]") {
  const std::vector<std::pair<std::string, std::vector<int64_t>>> shapes = {
      {"a", {3}}, {"b", {2, 5}}, {"c", {1}}};
  SegmentInfo s = LayoutSegment(shapes, "seg", DType::kBF16, 16);
  CHECK(s.shm_name == "seg");
  REQUIRE(s.tensors.size() == 3);
  CHECK(s.tensors[0].offset == 0);
  CHECK(s.tensors[0].nbytes == 6);
  CHECK(s.tensors[1].offset == 16);  // 6 rounded up to 16
  CHECK(s.tensors[1].nbytes == 20);
  CHECK(s.tensors[2].offset == 48);  // 36 rounded up to 48
  CHECK(s.tensors[2].dtype == DType::kBF16);
  CHECK(s.tensors[2].shape == std::vector<int64_t>{1});
  CHECK(s.nbytes == 50);
  CHECK(LayoutSegment(shapes, "", DType::kF32, 256).nbytes == 512 + 4);
  CHECK_THROWS_WITH(LayoutSegment(shapes, "", DType::kBF16, 24), Catch::Contains("power of two"));
}
