// train.keep_best: the best checkpoint's adapter sits at OUTPUT_DIR/best/, and the run's last
// lines name it.
#include "torch_catch.h"  // first: see there

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "common/formats/checkpoint_dir.h"
#include "worker_test_util.h"

using namespace lorastream;

TEST_CASE("keep_best: the run ends naming OUTPUT_DIR/best, a copy of the best adapter",
          "[worker][best]") {
  testing::TempDir dir("best-adapter");
  testing::MakeCheckpoint(dir / "m", "tiny");
  testing::WriteJsonl(dir / "d.jsonl", 4, 32, 32, 512);
  std::ofstream(dir / "job.toml")
      << "name = \"best\"\n[model]\ncheckpoint = \"m\"\n[data]\npath = \"d.jsonl\"\nseq_len = 32\n"
         "[lora]\nrank = 4\nalpha = 8\n[optim]\nlr = 0.05\n"
         "[train]\nsteps = 4\nbatch_size = 2\ncheckpoint_every = 1\nkeep_checkpoints = 1\n"
         "keep_best = true\noutput_dir = \"out\"\n[eval]\npath = \"d.jsonl\"\nevery = 1\n";
  const std::string cmd = std::string(LORASTREAM_BIN_DIR) + "/lorastream-worker train " +
                          (dir / "job.toml") + " --device cpu --threads 1 > " + (dir / "log") +
                          " 2>&1";
  const int status = std::system(cmd.c_str());
  const std::string log = testing::ReadFile(dir / "log");
  INFO(log);
  REQUIRE(status == 0);
  const std::string best = dir / "out/best";
  CHECK(BestAdapterDir(dir / "out") == best);
  const nlohmann::json note = nlohmann::json::parse(testing::ReadFile(best + "/best.json"));
  const std::string checkpoint = note["checkpoint"].get<std::string>();
  CHECK(testing::ReadFile(best + "/adapter_model.safetensors") ==
        testing::ReadFile(dir / ("out/" + checkpoint + "/adapter_model.safetensors")));
  CHECK(std::filesystem::exists(best + "/adapter_config.json"));
  // The last line names it.
  const size_t last = log.rfind("best adapter (" + checkpoint);
  REQUIRE(last != std::string::npos);
  CHECK(log.find(best, last) != std::string::npos);
}
