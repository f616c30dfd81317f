// peft's adapter_config.json, torch-free: what the trainer writes reads back as the same
// settings, and every field it cannot honour is refused by name. (The tensors beside it are
// tests/worker/adapter_test.cc's.)
#include <fstream>
#include <initializer_list>
#include <string>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "common/base/error.h"
#include "common/job/job_spec.h"
#include "tests/support/test_support.h"
#include "worker/model/lora_settings.h"
#include "worker/model/peft_config.h"

using namespace lorastream;
using namespace lorastream::worker;

namespace {

// Writes `config` as adapter_config.json into `dir` and returns the file's path.
std::string WriteConfig(const testing::TempDir& dir, const nlohmann::json& config) {
  const std::string path = dir / "adapter_config.json";
  std::ofstream(path) << config.dump(2);
  return path;
}

// ReadPeftConfig's error for `config`, with `code` checked ("" when it was accepted).
std::string Refusal(const testing::TempDir& dir, const nlohmann::json& config, ErrorCode code) {
  const std::string path = WriteConfig(dir, config);
  try {
    ReadPeftConfig(path);
  } catch (const Error& e) {
    CHECK(e.code() == code);
    return e.what();
  }
  return "";
}

LoraSettings Settings(int64_t rank, double alpha, double dropout, bool rslora,
                      std::initializer_list<int> targets) {
  LoraSettings s{rank, alpha, dropout, rslora, {}};
  for (int t : targets) s.targets[t] = true;
  return s;
}

bool Mentions(const std::string& text, const std::string& what) {
  return text.find(what) != std::string::npos;
}

}  // namespace

TEST_CASE("peft config: what PeftConfigJson writes, ReadPeftConfig reads back", "[worker]") {
  testing::TempDir dir("peft-config");
  LoraSettings s = Settings(8, 12.5, 0.1, true, {kQProj, kDownProj, kGateProj});
  const std::string text = PeftConfigJson(s, "/models/tiny");
  const nlohmann::json j = nlohmann::json::parse(text);
  CHECK(j["target_modules"] == nlohmann::json({"down_proj", "gate_proj", "q_proj"}));
  CHECK(j["lora_alpha"] == 12.5);
  CHECK(j["base_model_name_or_path"] == "/models/tiny");

  const LoraSettings back = ReadPeftConfig(WriteConfig(dir, j));
  CHECK(back.rank == 8);
  CHECK(back.alpha == 12.5);
  CHECK(back.dropout == 0.1);
  CHECK(back.rslora);
  CHECK(back.targets == s.targets);

  // An integral alpha is written as an integer, as peft writes it.
  s.alpha = 16;
  CHECK(nlohmann::json::parse(PeftConfigJson(s, "m"))["lora_alpha"].is_number_integer());
}

TEST_CASE("peft config: fields this trainer cannot honour are refused by name", "[worker]") {
  testing::TempDir dir("peft-config-refused");
  const LoraSettings s = Settings(16, 32, 0, false, {kVProj});
  const nlohmann::json good = nlohmann::json::parse(PeftConfigJson(s, "m"));

  auto with = [&](const std::string& field, const nlohmann::json& value) {
    nlohmann::json j = good;
    j[field] = value;
    return j;
  };
  CHECK(Mentions(Refusal(dir, with("use_dora", true), ErrorCode::kUnsupported), "use_dora"));
  CHECK(Mentions(Refusal(dir, with("rank_pattern", {{"q_proj", 4}}), ErrorCode::kUnsupported),
                 "rank_pattern"));
  CHECK(Mentions(Refusal(dir, with("alpha_pattern", {{"q_proj", 4}}), ErrorCode::kUnsupported),
                 "alpha_pattern"));
  CHECK(Mentions(Refusal(dir, with("fan_in_fan_out", true), ErrorCode::kUnsupported),
                 "fan_in_fan_out"));
  CHECK(Mentions(Refusal(dir, with("bias", "all"), ErrorCode::kUnsupported), "bias"));
  CHECK(Mentions(Refusal(dir, with("layers_to_transform", {0, 1}), ErrorCode::kUnsupported),
                 "layers_to_transform"));
  CHECK(
      Mentions(Refusal(dir, with("target_modules", {"q_proj", "lm_head"}), ErrorCode::kUnsupported),
               "lm_head"));
  CHECK(Mentions(Refusal(dir, with("r", 0), ErrorCode::kCorrupt), "`r`"));
  CHECK(Mentions(Refusal(dir, with("r", "8"), ErrorCode::kCorrupt), "`r`"));
  CHECK(Mentions(Refusal(dir, with("lora_alpha", "16"), ErrorCode::kCorrupt), "lora_alpha"));
  CHECK(Mentions(Refusal(dir, with("use_rslora", 1), ErrorCode::kCorrupt), "use_rslora"));
  CHECK(Mentions(Refusal(dir, with("target_modules", 3), ErrorCode::kCorrupt), "target_modules"));
  CHECK(Mentions(Refusal(dir, with("peft_type", "IA3"), ErrorCode::kCorrupt), "peft_type"));
  CHECK(Mentions(Refusal(dir, nlohmann::json::array(), ErrorCode::kCorrupt), "JSON object"));

  // Fields peft writes as null or at their neutral value are accepted.
  CHECK(Refusal(dir, with("layers_to_transform", nullptr), ErrorCode::kOk).empty());
  CHECK(Refusal(dir, with("target_modules", "o_proj"), ErrorCode::kOk).empty());
  CHECK(ReadPeftConfig(WriteConfig(dir, with("target_modules", "o_proj"))).targets[kOProj]);

  try {
    ReadPeftConfig(dir / "missing.json");
    FAIL("a missing file was accepted");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kNotFound);
  }
}

TEST_CASE("LoRA settings from a job's spec: targets by name, unknown ones refused", "[worker]") {
  LoraSpec spec;
  spec.rank = 4;
  spec.alpha = 8;
  spec.targets = {"up_proj", "k_proj"};
  const LoraSettings s = LoraSettingsFromSpec(spec);
  CHECK(s.rank == 4);
  CHECK(s.Scale() == 2.0);
  CHECK(s.TargetNames() == std::vector<std::string>{"k_proj", "up_proj"});
  spec.rslora = true;
  CHECK(LoraSettingsFromSpec(spec).Scale() == 4.0);
  CHECK(LoraKey(3, kUpProj, true) == "base_model.model.model.layers.3.mlp.up_proj.lora_B.weight");

  spec.targets = {"q_proj", "qkv_proj"};
  try {
    LoraSettingsFromSpec(spec);
    FAIL("an unknown target was accepted");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kRefused);
    CHECK(Mentions(e.what(), "qkv_proj"));
  }
}
