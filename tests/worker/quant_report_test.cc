// `lorastream-worker quant-report` on a tiny model on the CPU: every figure is there and finite,
// and they order as the formats' bits do (fp8 keeps more of the weights than nf4).
#include <cmath>
#include <cstdlib>
#include <fstream>

#include <nlohmann/json.hpp>

#include <catch2/catch.hpp>

#include "worker_test_util.h"

using namespace lorastream;

TEST_CASE("quant-report: SQNR, KL and trained eval loss of fp8 and nf4 against bf16", "[worker]") {
  testing::TempDir dir("qreport");
  testing::MakeCheckpoint(dir / "m", "tiny");
  testing::WriteJsonl(dir / "d.jsonl", 24, 20, 40, 512);
  std::ofstream(dir / "job.toml") << "name = \"report\"\n[model]\ncheckpoint = \"m\"\n"
                                     "[data]\npath = \"d.jsonl\"\nseq_len = 32\n"
                                     "[lora]\nrank = 4\nalpha = 8\n[optim]\nlr = 1e-2\n"
                                     "[train]\nsteps = 3\nbatch_size = 2\noutput_dir = \"out\"\n"
                                     "[eval]\nsplit = 0.25\n";
  const std::string cmd = std::string(LORASTREAM_BIN_DIR) + "/lorastream-worker quant-report " +
                          (dir / "job.toml") + " --threads 2 --out " + (dir / "r.json") + " > " +
                          (dir / "log") + " 2>&1";
  const int status = std::system(cmd.c_str());
  const std::string log = testing::ReadFile(dir / "log");
  INFO(log);
  REQUIRE(status == 0);
  const nlohmann::json r = nlohmann::json::parse(testing::ReadFile(dir / "r.json"));
  CHECK(r["steps"] == 3);
  CHECK(r["kl_tokens"] == 2 * 2 * 32);
  auto finite = [](const nlohmann::json& v) {
    return v.is_number() && std::isfinite(v.get<double>());
  };
  CHECK(finite(r["bf16"]["base_eval_loss"]));
  CHECK(finite(r["bf16"]["trained_eval_loss"]));
  for (const char* f : {"fp8", "nf4"}) {
    INFO(f);
    const nlohmann::json& q = r[f];
    for (const char* k :
         {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "all"}) {
      INFO(k);
      CHECK(finite(q["sqnr_db"][k]));
      CHECK(q["sqnr_db"][k].get<double>() > 10);
    }
    CHECK(finite(q["kl_mean"]));
    CHECK(q["kl_mean"].get<double>() > 0);
    CHECK(q["kl_max"].get<double>() >= q["kl_mean"].get<double>());
    CHECK(finite(q["base_eval_loss"]));
    CHECK(finite(q["trained_eval_loss"]));
    CHECK(finite(q["expand_ms_per_block"]));
    CHECK(q["expand_ms_per_block"].get<double>() > 0);
    CHECK(q["block_bytes"].get<double>() < r["bf16"]["block_bytes"].get<double>());
  }
  // fp8 keeps more of the weights and of the model's predictions than nf4.
  CHECK(r["fp8"]["sqnr_db"]["all"].get<double>() > r["nf4"]["sqnr_db"]["all"].get<double>() + 5);
  CHECK(r["fp8"]["kl_mean"].get<double>() < r["nf4"]["kl_mean"].get<double>());
  // The table names every base.
  CHECK_THAT(log, Catch::Contains("bf16") && Catch::Contains("fp8") && Catch::Contains("nf4") &&
                      Catch::Contains("trained eval"));

  // A job without an evaluation set is refused, naming [eval].
  std::ofstream(dir / "noeval.toml") << "name = \"r\"\n[model]\ncheckpoint = \"m\"\n"
                                        "[data]\npath = \"d.jsonl\"\nseq_len = 32\n"
                                        "[train]\nsteps = 1\noutput_dir = \"out2\"\n";
  const std::string bad = std::string(LORASTREAM_BIN_DIR) + "/lorastream-worker quant-report " +
                          (dir / "noeval.toml") + " > " + (dir / "log2") + " 2>&1";
  CHECK(std::system(bad.c_str()) != 0);
  CHECK_THAT(testing::ReadFile(dir / "log2"), Catch::Contains("[eval]"));
}
