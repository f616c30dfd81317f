// Job groups beside a hostile job, run as a user runs them (`lorastream-worker train A.toml
// B.toml`): a job too big for the worker's memory fails alone, naming it, and the good job ends
// done with the adapter and checkpoints it has alone — whether the big job is refused by its
// memory estimate before it joins (in either order) or exhausts the process's memory inside
// the group's shared step (the group splits; each job retries its step alone).
#include "torch_catch.h"  // first: see there

#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <string>

#include "common/job/job_spec.h"
#include "worker/train/group_trainer.h"
#include "worker/train/stream_provider.h"
#include "worker_test_util.h"

using namespace lorastream;
using namespace lorastream::worker;

namespace {

class HostileGroup {
 public:
  // A model whose positions reach 4096 tokens, a good job "a" and the hostile "b" (its
  // batch_size and seq_len given), each over its own data.
  HostileGroup(const std::string& tag, int b_batch, int b_seq_len) : dir_(tag) {
    testing::MakeCheckpointOfShape(dir_ / "model",
                                   "model_type = \"qwen3\"\nhidden_size = 64\n"
                                   "intermediate_size = 128\nnum_hidden_layers = 2\n"
                                   "num_attention_heads = 8\nnum_key_value_heads = 4\n"
                                   "head_dim = 16\nvocab_size = 320\n"
                                   "max_position_embeddings = 4096\nrope_theta = 10000.0\n"
                                   "rms_norm_eps = 1e-6\ntie_word_embeddings = false\n",
                                   5);
    testing::WriteJsonl(dir_ / "a.jsonl", 8, 10, 60, 320, 1);
    testing::WriteJsonl(dir_ / "b.jsonl", 4, b_seq_len, b_seq_len, 320, 2);
    WriteJob("a", "a", 2, 16, "out-a");
    WriteJob("a-alone", "a", 2, 16, "out-a-alone");
    WriteJob("b", "b", b_batch, b_seq_len, "out-b");
  }

  // `lorastream-worker ARGS` under `limit` ("" or a shell line run first, e.g. "ulimit -v N");
  // its exit status, its output in log.
  int Run(const std::string& args, const std::string& limit = "") {
    const std::string cmd = "cd " + dir_.str() + " && (" + (limit.empty() ? "" : limit + " && ") +
                            "exec " + LORASTREAM_BIN_DIR + "/lorastream-worker " + args +
                            " --device cpu --threads 1 --no-resume) > log 2>&1";
    const int status = std::system(cmd.c_str());
    log_ = testing::ReadFile(dir_ / "log");
    return status;
  }
  const std::string& log() const { return log_; }
  std::string Path(const std::string& relative) const { return dir_ / relative; }

  // The last run: b failed (one line, no backtrace, no adapter), and a ended done with the
  // adapter and checkpoints of its run alone, byte for byte.
  void RequireBFailedAAsAlone() const {
    INFO(log_);
    CHECK(log_.find("a: done: 4 steps") != std::string::npos);
    CHECK(log_.find("b: failed: ") != std::string::npos);
    CHECK(log_.find("frame #") == std::string::npos);
    CHECK(::access((dir_ / "out-b/adapter_model.safetensors").c_str(), F_OK) != 0);
    const std::string got = dir_ / "out-a", want = dir_ / "out-a-alone";
    REQUIRE(testing::ReadFile(got + "/adapter_model.safetensors") ==
            testing::ReadFile(want + "/adapter_model.safetensors"));
    for (const char* c : {"checkpoint-2", "checkpoint-4"})
      for (const char* f : {"adapter_model.safetensors", "trainer_state.safetensors"}) {
        INFO(c << "/" << f);
        REQUIRE(!testing::ReadFile(want + "/" + c + "/" + f).empty());
        REQUIRE(testing::ReadFile(got + "/" + c + "/" + f) ==
                testing::ReadFile(want + "/" + c + "/" + f));
      }
  }

  // (rm, not std::filesystem::remove_all: the CUDA build's libstdc++ is the torch wheel's,
  // whose remove_all crashes: docs/DEVELOPING.md)
  void Clean() {
    REQUIRE(std::system(("rm -rf " + (dir_ / "out-a") + " " + (dir_ / "out-b")).c_str()) == 0);
  }

 private:
  void WriteJob(const std::string& file, const std::string& name, int batch, int seq_len,
                const std::string& out) {
    std::ofstream(dir_ / (file + ".toml"))
        << "name = \"" << name << "\"\n[model]\ncheckpoint = \"" << (dir_ / "model/m")
        << "\"\n[data]\npath = \"" << (dir_ / (name + ".jsonl")) << "\"\nseq_len = " << seq_len
        << "\n[lora]\nrank = 4\n[train]\nsteps = 4\nbatch_size = " << batch
        << "\ncheckpoint_every = 2\nseed = 9\noutput_dir = \"" << (dir_ / out) << "\"\n";
  }

  testing::TempDir dir_;
  std::string log_;
};

}  // namespace

TEST_CASE(
    "group: a job whose estimate exceeds the host's memory is refused alone, naming it, in "
    "either order; the other trains as it does alone",
    "[worker]") {
  // 256 sequences of 4096 tokens a micro-batch: terabytes of attention scores by the estimate.
  HostileGroup g("group-hostile-estimate", 256, 4096);
  REQUIRE(g.Run("train a-alone.toml") == 0);
  for (const char* order : {"a.toml b.toml", "b.toml a.toml"}) {
    INFO(order);
    g.Clean();
    CHECK(g.Run(std::string("train ") + order) != 0);  // a job failed
    INFO(g.log());
    CHECK(g.log().find("job b") != std::string::npos);
    CHECK(g.log().find("estimated peak memory") != std::string::npos);
    g.RequireBFailedAAsAlone();
  }
}

TEST_CASE(
    "group: a job that exhausts the process's memory inside the group's step fails alone; the "
    "other ends done as it does alone",
    "[worker]") {
  // 2 sequences of 4096 tokens: within the host's memory by the estimate, so b joins; its
  // attention scores (2 x 8 heads x 4096 x 4096 floats, 1 GiB each) exceed the 1.5 GB of
  // data (heap and anonymous mappings, RLIMIT_DATA) the run is given, where a (16 tokens) needs
  // far less.
  HostileGroup g("group-hostile-alloc", 2, 4096);
  REQUIRE(g.Run("train a-alone.toml") == 0);
  CHECK(g.Run("train a.toml b.toml", "ulimit -d 1500000") != 0);
  INFO(g.log());
  CHECK(g.log().find("the group splits") != std::string::npos);
  g.RequireBFailedAAsAlone();
}

TEST_CASE(
    "group: a job asking to join a running group is refused by the group's estimate with it, "
    "naming it; a job that fits joins",
    "[worker]") {
  HostileGroup g("group-join", 256, 4096);
  TrainOptions o;
  o.resume = false;
  o.threads = 1;
  o.make_provider = [](const JobSpec& j, const BaseWeights& b, const std::string& d,
                       const std::string& t, const std::vector<JobSpec>& group) {
    StreamEngineOptions opt;
    opt.log_plan = false;
    return MakeStreamProvider(j, b, d, t, opt, group);
  };
  const JobSpec a = LoadJobSpec(g.Path("a.toml"));
  GroupTrainer group(a, o);
  group.Add(GroupJob{a, {}, {}, {}});
  REQUIRE(group.Step());
  const std::string why = group.JoinRefusal(LoadJobSpec(g.Path("b.toml")));
  CHECK_THAT(why,
             Catch::Contains("job b does not fit beside the group's 1 job(s) under its plan") &&
                 Catch::Contains("exceeds the host's memory (cpu)"));
  CHECK(group.JoinRefusal(LoadJobSpec(g.Path("a-alone.toml"))).empty());
  group.Run();
  CHECK(!group.TakeLeft().at(0).error);
}
