// One validation of a checkpoint folder (store/layout.h PlanPack) behind serve and inspect:
// NaN/inf weights and a config.json that disagrees with the tensors are refused, naming the
// tensor. The worker's direct load runs the same function (tests/worker/trainer_test.cc).
// Also the exit statuses of lorastream-store and lorastream-synth (common/base/cli_main.h).
#include <catch2/catch.hpp>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <regex>
#include <sstream>

#include "common/base/error.h"
#include "common/formats/safetensors.h"
#include "common/posix/subprocess.h"
#include "store/inspect.h"
#include "store/layout.h"
#include "test_util.h"

using namespace lorastream;
using namespace lorastream::store;
using namespace lorastream::testing;

namespace {

std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Overwrites element `index` of an f32 tensor of a single-file checkpoint.
void PokeF32(const std::string& dir, const std::string& tensor, size_t index, float value) {
  const std::string file = dir + "/model.safetensors";
  uint64_t at = 0;
  {
    SafetensorsFile f = SafetensorsFile::Open(file);
    const SafetensorsEntry* e = f.Find(tensor);
    REQUIRE(e != nullptr);
    at = f.header().data_offset + e->begin + index * sizeof(float);
  }
  std::fstream out(file, std::ios::in | std::ios::out | std::ios::binary);
  out.seekp(static_cast<std::streamoff>(at));
  out.write(reinterpret_cast<const char*>(&value), sizeof value);
}

std::string Refusal(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kCorrupt);
    return e.what();
  }
  return "(accepted)";
}

std::string Run(const std::vector<std::string>& argv, int* code, const std::string& err) {
  return RunAndCapture(argv, code, 120, err);
}

}  // namespace

TEST_CASE("NaN or infinite base weights are refused by inspect, serve and PlanPack", "[store]") {
  TempDir dir("ckval");
  const std::string model = dir / "m";
  Synth("tiny", model, 1, "f32");
  CHECK_NOTHROW(PlanPack(Checkpoint::Open(model), PackOptions{}));
  PokeF32(model, "model.layers.1.mlp.up_proj.weight", 7, std::numeric_limits<float>::quiet_NaN());
  const std::string why = Refusal([&] { PlanPack(Checkpoint::Open(model), PackOptions{}); });
  CHECK_THAT(why, Catch::Contains("tensor `model.layers.1.mlp.up_proj.weight` holds a NaN or "
                                  "infinite value (element 7)"));
  std::ostringstream listing;
  CHECK_THAT(Refusal([&] { RunInspect(model, listing); }),
             Catch::Contains("model.layers.1.mlp.up_proj.weight"));
  PokeF32(model, "model.layers.1.mlp.up_proj.weight", 7, 0.5f);
  PokeF32(model, "model.norm.weight", 0, -std::numeric_limits<float>::infinity());
  CHECK_THAT(Refusal([&] { PlanPack(Checkpoint::Open(model), PackOptions{}); }),
             Catch::Contains("tensor `model.norm.weight` holds a NaN or infinite value"));

  int code = -1;
  const std::string err = dir / "serve.err";
  Run({Bin("lorastream-store"), "serve", model, "--name", UniqueName("nan"), "--no-lock"}, &code,
      err);
  CHECK(code == 4);  // corrupt input
  CHECK_THAT(Slurp(err), Catch::Contains("model.norm.weight` holds a NaN or infinite value"));
}

TEST_CASE("a config.json with fewer layers than the tensors is refused by the one validation",
          "[store]") {
  TempDir dir("ckval");
  const std::string model = dir / "m";
  Synth("tiny", model, 1, "f32", 4ull << 30, /*layers=*/4);
  // Say 2 layers while the file holds 4.
  std::string config = Slurp(model + "/config.json");
  config = std::regex_replace(config, std::regex("\"num_hidden_layers\": *4"),
                              "\"num_hidden_layers\": 2");
  REQUIRE(config.find("\"num_hidden_layers\": 2") != std::string::npos);
  std::ofstream(model + "/config.json", std::ios::trunc) << config;
  CHECK_THAT(Refusal([&] { PlanPack(Checkpoint::Open(model), PackOptions{}); }),
             Catch::Contains("belongs to block 2 but config.json has num_hidden_layers = 2"));
  int code = -1;
  Run({Bin("lorastream-store"), "inspect", model}, &code, dir / "inspect.err");
  CHECK(code == 4);
  CHECK_THAT(Slurp(dir / "inspect.err"), Catch::Contains("num_hidden_layers = 2"));
}

TEST_CASE("lorastream-store and lorastream-synth exit with the documented codes", "[store]") {
  TempDir dir("ckval");
  int code = -1;
  const std::string err = dir / "err";
  Run({Bin("lorastream-store"), "--no-such-option"}, &code, err);
  CHECK(code == 2);  // bad argument (CLI11 alone would exit 109)
  Run({Bin("lorastream-store"), "inspect"}, &code, err);
  CHECK(code == 2);  // a required argument missing (CLI11: 106)
  Run({Bin("lorastream-store"), "inspect", dir / "nothing"}, &code, err);
  CHECK(code == 3);  // not found
  Run({Bin("lorastream-store"), "--help"}, &code, err);
  CHECK(code == 0);
  Run({Bin("lorastream-synth"), "--preset"}, &code, err);
  CHECK(code == 2);
  Run({Bin("lorastream-synth"), "--preset", "no-such-preset", "--out", dir / "o"}, &code, err);
  CHECK(code == 3);
}

TEST_CASE("lorastream-synth refuses an --out folder that holds files unless --force", "[store]") {
  TempDir dir("synth-force");
  const std::string out = dir / "ckpt";
  // A user's sharded checkpoint: four shards and their index.
  std::filesystem::create_directories(out);
  for (const char* name : {"model-00001-of-00004.safetensors", "model-00002-of-00004.safetensors",
                           "model-00003-of-00004.safetensors", "model-00004-of-00004.safetensors",
                           "model.safetensors.index.json"})
    std::ofstream(out + "/" + name) << "the user's";
  int code = -1;
  const std::string err = dir / "err";
  const std::vector<std::string> synth = {
      Bin("lorastream-synth"), "--preset", "tiny", "--presets-dir", PresetsDir(), "--out", out};
  Run(synth, &code, err);
  CHECK(code == 2);
  CHECK_THAT(Slurp(err), Catch::Contains("--out " + out + " is not empty"));
  CHECK_THAT(Slurp(err), Catch::Contains("--force"));
  CHECK(Slurp(out + "/model-00003-of-00004.safetensors") == "the user's");
  CHECK(Slurp(out + "/model.safetensors.index.json") == "the user's");

  std::vector<std::string> forced = synth;
  forced.push_back("--force");
  Run(forced, &code, err);
  CHECK(code == 0);
  CHECK_FALSE(std::filesystem::exists(out + "/model-00003-of-00004.safetensors"));
  CHECK(Checkpoint::Open(out).config().num_hidden_layers > 0);
  for (const auto& e : std::filesystem::directory_iterator(out))  // nothing half-written left
    CHECK(e.path().filename().string().find(".tmp") == std::string::npos);

  Run({Bin("lorastream-synth"), "--preset", "tiny", "--presets-dir", PresetsDir(), "--out",
       dir / "new"},
      &code, err);
  CHECK(code == 0);  // a folder that does not exist yet needs nothing
}
