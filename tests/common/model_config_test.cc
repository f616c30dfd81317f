// config.json parsing: sliding-window attention is recognised the way transformers applies it,
// survives the manifest's JSON, and a job whose sequences do not fit the window is refused.
#include "common/formats/model_config.h"

#include <fstream>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "common/job/job_spec.h"

using namespace lorastream;

namespace {

nlohmann::json Base(const std::string& type) {
  return {{"model_type", type},       {"hidden_size", 64},
          {"intermediate_size", 128}, {"num_hidden_layers", 4},
          {"num_attention_heads", 4}, {"num_key_value_heads", 2},
          {"vocab_size", 512},        {"max_position_embeddings", 4096}};
}

int64_t Window(const nlohmann::json& j) {
  return ParseModelConfig(j.dump(), "config.json").sliding_window;
}

}  // namespace

TEST_CASE("sliding_window is taken as transformers applies it", "[common]") {
  auto mistral = Base("mistral");
  CHECK(Window(mistral) == 0);
  mistral["sliding_window"] = nullptr;
  CHECK(Window(mistral) == 0);
  mistral["sliding_window"] = 1024;
  CHECK(Window(mistral) == 1024);  // mistral: whenever it is set

  auto qwen = Base("qwen2");
  qwen["sliding_window"] = 1024;
  CHECK(Window(qwen) == 0);  // qwen2: only with use_sliding_window
  qwen["use_sliding_window"] = true;
  CHECK(Window(qwen) == 1024);
  qwen["max_window_layers"] = 4;  // layers >= 4 slide: none of 4 layers
  CHECK(Window(qwen) == 0);
  qwen["max_window_layers"] = 2;
  CHECK(Window(qwen) == 1024);

  auto qwen3 = Base("qwen3");
  qwen3["sliding_window"] = 512;
  qwen3["use_sliding_window"] = false;
  qwen3["layer_types"] = {"full_attention", "sliding_attention", "full_attention",
                          "full_attention"};
  CHECK(Window(qwen3) == 512);  // transformers 5 lists it per layer

  auto llama = Base("llama");
  llama["sliding_window"] = 16;  // llama has no sliding window: ignored
  CHECK(Window(llama) == 0);

  mistral["sliding_window"] = "wide";
  CHECK_THROWS_WITH(Window(mistral), Catch::Contains("sliding_window"));
  mistral["sliding_window"] = -5;
  CHECK_THROWS_WITH(Window(mistral), Catch::Contains("sliding_window"));
}

TEST_CASE("the window survives the manifest's config JSON", "[common]") {
  for (const char* type : {"mistral", "qwen2", "qwen3"}) {
    auto j = Base(type);
    j["sliding_window"] = 256;
    j["use_sliding_window"] = true;
    ModelConfig c = ParseModelConfig(j.dump(), "config.json");
    nlohmann::json out;
    ToJson(out, c);
    CHECK(ModelConfigFromJson(out, "manifest").sliding_window == 256);
    c.sliding_window = 0;
    ToJson(out, c);
    CHECK(ModelConfigFromJson(out, "manifest").sliding_window == 0);
  }
}

TEST_CASE("a job longer than the model's attention window is refused, one within it is not",
          "[common]") {
  auto j = Base("mistral");
  j["sliding_window"] = 256;
  ModelConfig model = ParseModelConfig(j.dump(), "config.json");
  JobSpec spec;
  spec.model.store = "m";
  spec.data.path = "/tmp/lorastream-model-config-test.jsonl";
  std::ofstream(spec.data.path) << "{\"input_ids\": [1, 2, 3]}\n";
  spec.data.format = "jsonl";
  spec.train.steps = 1;
  spec.train.output_dir = "/tmp/out";
  spec.data.seq_len = 256;
  for (const auto& p : ValidateJobSpec(spec, &model)) FAIL_CHECK(p);
  spec.data.seq_len = 257;
  auto problems = ValidateJobSpec(spec, &model);
  REQUIRE(problems.size() == 1);
  CHECK_THAT(problems[0],
             Catch::Contains("`data.seq_len` is 257") && Catch::Contains("sliding_window = 256"));
}

TEST_CASE("numbers in config.json that would be undefined or meaningless are refused by name",
          "[common]") {
  auto with = [](const char* field, nlohmann::json value) {
    auto j = Base("llama");
    j[field] = std::move(value);
    return j.dump();
  };
  CHECK_THROWS_WITH(ParseModelConfig(with("rope_theta", 0), "c"), Catch::Contains("rope_theta"));
  CHECK_THROWS_WITH(ParseModelConfig(with("rms_norm_eps", -1e-6), "c"),
                    Catch::Contains("rms_norm_eps"));
  CHECK_THROWS_WITH(
      ParseModelConfig(with("rope_scaling", {{"rope_type", "llama3"},
                                             {"factor", 8.0},
                                             {"original_max_position_embeddings", 1e300}}),
                       "c"),
      Catch::Contains("original_max_position_embeddings"));
  CHECK_THROWS_WITH(
      ParseModelConfig(with("rope_scaling", {{"rope_type", "linear"}, {"factor", 0}}), "c"),
      Catch::Contains("factor"));
  auto qwen = Base("qwen2");
  qwen["sliding_window"] = 64;
  qwen["use_sliding_window"] = true;
  qwen["max_window_layers"] = 2.5;
  CHECK_THROWS_WITH(ParseModelConfig(qwen.dump(), "c"), Catch::Contains("max_window_layers"));
}
