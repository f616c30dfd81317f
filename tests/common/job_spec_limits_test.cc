// Sizes that reach an allocation are bounded by ValidateJobSpec (so `submit` and `worker
// train` refuse them before any memory is taken), and the retention keys are checked.
#include <catch2/catch.hpp>

#include "common/base/error.h"
#include "common/formats/model_config.h"
#include "common/job/job_spec.h"

using namespace lorastream;

namespace {

JobSpec Parse(const std::string& train) {
  return ParseJobSpec(
      "[model]\nstore = \"s\"\n[data]\npath = \"/d.jsonl\"\n[train]\n"
      "output_dir = \"/o\"\n" +
          train,
      "j.toml");
}

std::string Problems(const JobSpec& s, const ModelConfig* model = nullptr) {
  std::string all;
  for (const auto& p : ValidateJobSpec(s, model)) all += p + "\n";
  return all;
}

}  // namespace

TEST_CASE("sizes that reach an allocation are refused, naming the key, value and limit",
          "[common]") {
  CHECK_THAT(Problems(Parse("steps = 10\nbatch_size = 100000000\n")),
             Catch::Contains("j.toml: key `train.batch_size` is 100000000, above the limit of "
                             "1048576"));
  CHECK_THAT(Problems(Parse("steps = 10\ngrad_accum = 4600000000000000000\n")),
             Catch::Contains("key `train.grad_accum` is 4600000000000000000, above the limit of "
                             "65536"));
  // Within each bound on its own, too many tokens per micro-batch together.
  JobSpec s = Parse("steps = 10\nbatch_size = 4096\n");
  s.data.seq_len = 4096;
  CHECK_THAT(Problems(s), Catch::Contains("`train.batch_size` times `data.seq_len` is 4096 x "
                                          "4096 = 16777216 tokens per micro-batch, above the "
                                          "limit of 1048576"));
  CHECK_THAT(Problems(Parse("steps = 2000000000\n")),
             Catch::Contains("`train.steps` is 2000000000, above the limit of 1073741824"));
  CHECK_THAT(Problems(Parse("steps = 1073741824\nbatch_size = 1048576\ngrad_accum = 65536\n")),
             Catch::Contains("sequences, above the limit of 2^62"));
  s = Parse("steps = 10\n");
  s.lora.rank = 100000;
  CHECK_THAT(Problems(s), Catch::Contains("`lora.rank` is 100000, above the limit of 65536"));
  s.lora.rank = 16;
  s.stream.ring_size = 5000;
  CHECK_THAT(Problems(s), Catch::Contains("`stream.ring_size` is 5000, above the limit of 1024"));

  // With the model known: the logits of a micro-batch and the rank against the width.
  ModelConfig m;
  m.model_type = "llama";
  m.hidden_size = 64;
  m.vocab_size = 128256;
  m.max_position_embeddings = 1 << 20;
  m.num_hidden_layers = 2;
  s = Parse("steps = 10\nbatch_size = 256\n");
  s.data.seq_len = 4096;  // 1048576 tokens: within the token bound
  s.lora.rank = 128;
  const std::string with_model = Problems(s, &m);
  CHECK_THAT(with_model, Catch::Contains("their logits over the model's vocabulary of 128256"));
  CHECK_THAT(with_model,
             Catch::Contains("`lora.rank` is 128, above the model's hidden_size of 64"));

  // A job that fits says nothing about limits.
  s = Parse("steps = 100\nbatch_size = 8\ngrad_accum = 16\n");
  s.data.seq_len = 2048;
  CHECK_THAT(Problems(s), !Catch::Contains("limit") && !Catch::Contains("train."));
}

TEST_CASE("a missing train.steps is reported as required", "[common]") {
  const std::string p = Problems(Parse(""));
  CHECK_THAT(p, Catch::Contains("`train.steps` is required"));
  CHECK_THAT(p, !Catch::Contains("found 0"));
  CHECK_THAT(Problems(Parse("steps = -3\n")),
             Catch::Contains("`train.steps` must be > 0 (found -3)"));
}

TEST_CASE("checkpoint retention keys: defaults, bounds and types", "[common]") {
  JobSpec d = Parse("steps = 1\n");
  CHECK(d.train.keep_checkpoints == 2);
  CHECK(!d.train.keep_best);
  JobSpec k = Parse("steps = 1\nkeep_checkpoints = 5\nkeep_best = true\n");
  CHECK(k.train.keep_checkpoints == 5);
  CHECK(k.train.keep_best);
  CHECK_THAT(Problems(Parse("steps = 1\nkeep_checkpoints = 0\n")),
             Catch::Contains("`train.keep_checkpoints` must be >= 1 (found 0)"));
  CHECK_THAT(Problems(Parse("steps = 1\nkeep_checkpoints = 5000\n")),
             Catch::Contains("`train.keep_checkpoints` is 5000, above the limit of 1000"));
  CHECK_THROWS_AS(Parse("steps = 1\nkeep_best = \"yes\"\n"), Error);
}
