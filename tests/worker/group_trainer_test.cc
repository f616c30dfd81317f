// Job groups (worker/train/group_trainer.h): a job trained in a group of 2 or 3 gives the
// losses, gradient norms, adapter and checkpoints it gives alone; a streamed group equals a
// resident one and copies what one job copies; a group job's checkpoint resumes alone; a job
// that fails leaves the others training; jobs join and leave at step boundaries; jobs that
// cannot share a group are refused naming the field.
//
// Bit for bit: the group's base GEMMs run over the concatenation of every job's rows, and on
// the CPU each row of a GEMM's result is the same sums in the same order whatever the number
// of rows (these tests hold it bit for bit, f32); everything else a job computes is its own.
#include "torch_catch.h"  // first: see there

#include "worker/train/group_trainer.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>

#include "common/base/error.h"
#include "worker/model/base_weights.h"
#include "worker/train/stream_provider.h"
#include "worker_test_util.h"

using namespace lorastream;
using namespace lorastream::worker;

namespace {

struct Record {
  std::vector<double> losses, grad_norms;
  std::vector<StepStats> stats;
};

// Three jobs that differ in everything a job of a group may keep its own.
class Jobs {
 public:
  Jobs() {
    testing::MakeCheckpoint(dir_ / "m", "tiny-qwen3");
    testing::WriteJsonl(dir_ / "a.jsonl", 8, 10, 60, 320, 1);
    testing::WriteJsonl(dir_ / "b.jsonl", 8, 10, 60, 320, 2);
    testing::WriteJsonl(dir_ / "c.jsonl", 8, 10, 60, 320, 3);
  }

  // Job "a", "b" or "c", writing into out/<name>-<tag>.
  JobSpec Spec(const std::string& name, const std::string& tag) const {
    JobSpec s = testing::TinyJob(dir_ / "m", dir_ / (name + ".jsonl"), dir_ / (name + "-" + tag));
    s.name = name;
    s.train.steps = 4;
    s.train.checkpoint_every = 2;
    if (name == "a") {
      s.data.seq_len = 16;
      s.lora.rank = 4;
      s.train.grad_accum = 2;
      s.train.seed = 11;
      s.optim.lr = 1e-2;
      s.optim.schedule = "cosine";
      s.optim.warmup_steps = 1;
    } else if (name == "b") {
      s.data.seq_len = 24;
      s.lora.rank = 8;
      s.lora.alpha = 4;
      s.lora.targets = {"q_proj", "v_proj", "down_proj"};
      s.lora.dropout = 0.1;
      s.train.batch_size = 1;
      s.train.grad_accum = 3;
      s.train.seed = 12;
      s.optim.lr = 3e-2;
      s.optim.grad_clip = 0.5;
    } else {
      s.data.seq_len = 32;
      s.lora.rank = 2;
      s.lora.targets = {"gate_proj", "up_proj", "o_proj"};
      s.lora.rslora = true;
      s.train.steps = 3;
      s.train.seed = 13;
      s.optim.lr = 5e-3;
      s.optim.weight_decay = 0.01;
    }
    return s;
  }

  TrainOptions Options(int swap = -1) const {
    TrainOptions o;
    o.resume = false;
    o.threads = 1;  // 2 cores shared with the rest of CI
    if (swap >= 0) {
      o.make_provider = [swap](const JobSpec& j, const BaseWeights& b, const std::string& d,
                               const std::string& t, const std::vector<JobSpec>&) {
        JobSpec streamed = j;
        streamed.stream.blocks_to_swap = swap;
        streamed.stream.ring_size = 1;
        StreamEngineOptions opt;
        opt.log_plan = false;
        return MakeStreamProvider(streamed, b, d, t, opt);
      };
    }
    return o;
  }

  // The group of `names`, each writing into <name>-<tag>; each job's record by name.
  std::map<std::string, Record> Group(const std::vector<std::string>& names, const std::string& tag,
                                      const TrainOptions& o) {
    std::map<std::string, Record> records;
    std::vector<GroupJob> jobs;
    for (const std::string& n : names) {
      GroupJob j;
      j.spec = Spec(n, tag);
      j.on_step = [&records, n](const StepStats& s) {
        records[n].losses.push_back(s.loss);
        records[n].grad_norms.push_back(s.grad_norm);
        records[n].stats.push_back(s);
      };
      jobs.push_back(std::move(j));
    }
    for (const GroupJobOutcome& out : RunGroupTraining(std::move(jobs), o)) {
      INFO(out.name);
      REQUIRE(!out.error);
      REQUIRE(out.result.steps_done == Spec(out.name, tag).train.steps);
    }
    return records;
  }

  std::string Out(const std::string& name, const std::string& tag) const {
    return dir_ / (name + "-" + tag);
  }
  const testing::TempDir& dir() const { return dir_; }

 private:
  testing::TempDir dir_{"group"};
};

bool BitEqual(const std::vector<double>& a, const std::vector<double>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0;
}

// The job's adapter and every checkpoint's files are those of `want`'s folder, byte for byte.
void RequireSameOutput(const std::string& got, const std::string& want) {
  INFO(got << " vs " << want);
  REQUIRE(testing::ReadFile(got + "/adapter_model.safetensors") ==
          testing::ReadFile(want + "/adapter_model.safetensors"));
  int checkpoints = 0;
  for (const auto& e : std::filesystem::directory_iterator(want)) {
    const std::string name = e.path().filename();
    if (name.rfind("checkpoint-", 0) != 0) continue;
    ++checkpoints;
    for (const char* f : {"adapter_model.safetensors", "trainer_state.safetensors"})
      REQUIRE(testing::ReadFile(e.path() / f) == testing::ReadFile(got + "/" + name + "/" + f));
  }
  REQUIRE(checkpoints > 0);
}

}  // namespace

TEST_CASE("group: a job in a group of 2 or 3 trains as it does alone, bit for bit", "[worker]") {
  Jobs jobs;
  const TrainOptions o = jobs.Options();
  std::map<std::string, Record> alone;
  for (const char* n : {"a", "b", "c"}) alone[n] = jobs.Group({n}, "alone", o)[n];
  const auto two = jobs.Group({"a", "b"}, "two", o);
  const auto three = jobs.Group({"c", "a", "b"}, "three", o);
  for (const char* n : {"a", "b", "c"}) {
    CAPTURE(n);
    REQUIRE(alone[n].losses.size() == static_cast<size_t>(jobs.Spec(n, "").train.steps));
    REQUIRE(std::isfinite(alone[n].losses.back()));
    if (two.count(n)) {
      CHECK(BitEqual(two.at(n).losses, alone[n].losses));
      CHECK(BitEqual(two.at(n).grad_norms, alone[n].grad_norms));
      RequireSameOutput(jobs.Out(n, "two"), jobs.Out(n, "alone"));
    }
    CHECK(BitEqual(three.at(n).losses, alone[n].losses));
    CHECK(BitEqual(three.at(n).grad_norms, alone[n].grad_norms));
    RequireSameOutput(jobs.Out(n, "three"), jobs.Out(n, "alone"));
  }
  // RunTraining is a group of one.
  JobSpec a = jobs.Spec("a", "run");
  std::vector<double> losses;
  RunTraining(a, o, [&](const StepStats& s) { losses.push_back(s.loss); });
  CHECK(BitEqual(losses, alone["a"].losses));
  RequireSameOutput(jobs.Out("a", "run"), jobs.Out("a", "alone"));
}

TEST_CASE("group: a streamed group equals the resident group and copies what one job copies",
          "[worker]") {
  Jobs jobs;
  const auto resident = jobs.Group({"a", "b"}, "resident", jobs.Options());
  const auto streamed = jobs.Group({"a", "b"}, "streamed", jobs.Options(/*swap=*/3));
  const auto alone = jobs.Group({"a"}, "alone", jobs.Options(/*swap=*/3));
  for (const char* n : {"a", "b"}) {
    CAPTURE(n);
    CHECK(BitEqual(streamed.at(n).losses, resident.at(n).losses));
    CHECK(BitEqual(streamed.at(n).grad_norms, resident.at(n).grad_norms));
    RequireSameOutput(jobs.Out(n, "streamed"), jobs.Out(n, "resident"));
  }
  // One copy of each block serves both jobs: per group micro-batch, the bytes of one job's
  // micro-batch (b's third micro-batch runs alone: a's step has two).
  const StepStats& one = alone.at("a").stats[1];
  const StepStats& group = streamed.at("a").stats[1];
  REQUIRE(one.h2d_bytes > 0);
  CHECK(group.h2d_bytes == one.h2d_bytes / 2 * 3);
  CHECK(group.copies == one.copies / 2 * 3);
  CHECK(streamed.at("b").stats[1].h2d_bytes == group.h2d_bytes);  // the group's, per job
}

TEST_CASE("group: a group job's checkpoint resumes alone and continues as uninterrupted",
          "[worker]") {
  Jobs jobs;
  TrainOptions o = jobs.Options();
  jobs.Group({"a"}, "alone", o);
  // a stops after two steps of a group with b and c, then resumes alone.
  {
    GroupTrainer group(jobs.Spec("a", "split"), o);
    // Asked to stop once its second step is done (should_stop is also polled between blocks).
    bool stop = false;
    group.Add(GroupJob{jobs.Spec("a", "split"),
                       [&](const StepStats& s) { stop = stop || s.step >= 2; },
                       [&] { return stop; },
                       {}});
    group.Add(GroupJob{jobs.Spec("b", "split"), {}, {}, {}});
    group.Add(GroupJob{jobs.Spec("c", "split"), {}, {}, {}});
    group.Run();
    for (const GroupJobOutcome& out : group.TakeLeft()) {
      REQUIRE(!out.error);
      if (out.name == "a") {
        CHECK(out.result.stopped);
        CHECK(out.result.steps_done == 2);
      }
    }
  }
  o.resume = true;
  const TrainResult rest = RunTraining(jobs.Spec("a", "split"), o);
  CHECK(rest.start_step == 2);
  RequireSameOutput(jobs.Out("a", "split"), jobs.Out("a", "alone"));
}

TEST_CASE("group: a job that fails leaves the others training, its failure its own", "[worker]") {
  Jobs jobs;
  const TrainOptions o = jobs.Options();
  const auto alone = jobs.Group({"a"}, "alone", o);
  testing::WriteJsonl(jobs.dir() / "big.jsonl", 3, 10, 20, 600);  // ids beyond the vocabulary
  JobSpec bad_data = jobs.Spec("b", "bad");
  bad_data.data.path = jobs.dir() / "big.jsonl";
  JobSpec diverging = jobs.Spec("c", "nan");
  diverging.optim.lr = 1e30;  // the first update overflows the adapter's output
  diverging.optim.grad_clip = 0;
  std::vector<double> a_losses;
  std::vector<GroupJob> group;
  group.push_back(GroupJob{
      jobs.Spec("a", "group"), [&](const StepStats& s) { a_losses.push_back(s.loss); }, {}, {}});
  group.push_back(GroupJob{bad_data, {}, {}, {}});
  group.push_back(GroupJob{diverging, {}, {}, {}});
  const std::vector<GroupJobOutcome> out = RunGroupTraining(std::move(group), o);
  REQUIRE(out.size() == 3);
  CHECK(!out[0].error);
  CHECK(BitEqual(a_losses, alone.at("a").losses));
  RequireSameOutput(jobs.Out("a", "group"), jobs.Out("a", "alone"));
  auto message = [](const GroupJobOutcome& o) -> std::string {
    try {
      std::rethrow_exception(o.error);
    } catch (const std::exception& e) {
      return e.what();
    }
  };
  REQUIRE(out[1].error);
  CHECK_THAT(message(out[1]), Catch::Contains("big.jsonl") && Catch::Contains("vocab_size"));
  REQUIRE(out[2].error);
  CHECK_THAT(message(out[2]),
             Catch::Contains("job c: the loss is") && Catch::Contains("at step 2"));
  CHECK(out[2].result.steps_done == 1);
}

TEST_CASE(
    "group: a step that fails inside the shared forward and backward splits the group; the job "
    "that fails alone leaves, the others end as they do alone",
    "[worker]") {
  Jobs jobs;
  TrainOptions o = jobs.Options();
  const auto alone = jobs.Group({"a"}, "alone", o);
  const auto alone_c = jobs.Group({"c"}, "alone", o);
  // b's every forward and backward fails as an allocation failure would: the first group step
  // fails for all three, the group splits, b fails alone, a and c train on, each alone.
  o.debug_fail_job = "b";
  std::map<std::string, std::vector<double>> losses;
  std::vector<GroupJob> group;
  for (const char* n : {"a", "b", "c"})
    group.push_back(GroupJob{jobs.Spec(n, "split"),
                             [&losses, n](const StepStats& s) { losses[n].push_back(s.loss); },
                             {},
                             {}});
  const std::vector<GroupJobOutcome> out = RunGroupTraining(std::move(group), o);
  REQUIRE(out.size() == 3);
  CHECK(!out[0].error);
  CHECK(!out[2].error);
  REQUIRE(out[1].error);
  std::string why;
  try {
    std::rethrow_exception(out[1].error);
  } catch (const std::exception& e) {
    why = e.what();
  }
  CHECK_THAT(why, Catch::Contains("job b") && Catch::Contains("allocation failed"));
  CHECK(out[1].result.steps_done == 0);
  CHECK(losses.count("b") == 0);
  CHECK(BitEqual(losses["a"], alone.at("a").losses));
  CHECK(BitEqual(losses["c"], alone_c.at("c").losses));
  RequireSameOutput(jobs.Out("a", "split"), jobs.Out("a", "alone"));
  RequireSameOutput(jobs.Out("c", "split"), jobs.Out("c", "alone"));
}

TEST_CASE("group: jobs join and leave at step boundaries", "[worker]") {
  Jobs jobs;
  const TrainOptions o = jobs.Options();
  jobs.Group({"a"}, "alone", o);
  jobs.Group({"b"}, "alone", o);
  GroupTrainer group(jobs.Spec("a", "join"), o);
  group.Add(GroupJob{jobs.Spec("a", "join"), {}, {}, {}});
  REQUIRE(group.Step());
  REQUIRE(group.Step());
  group.Add(GroupJob{jobs.Spec("b", "join"), {}, {}, {}});  // joins a's third step
  CHECK(group.size() == 2);
  REQUIRE(group.Step());
  REQUIRE(group.Step());  // a's last: a leaves
  const std::vector<GroupJobOutcome> left = group.TakeLeft();
  REQUIRE(left.size() == 1);
  CHECK(left[0].name == "a");
  CHECK(group.size() == 1);
  group.Run();
  REQUIRE(group.TakeLeft().size() == 1);
  RequireSameOutput(jobs.Out("a", "join"), jobs.Out("a", "alone"));
  RequireSameOutput(jobs.Out("b", "join"), jobs.Out("b", "alone"));
}

TEST_CASE("group: jobs that cannot share a group are refused naming the field", "[worker]") {
  Jobs jobs;
  const JobSpec a = jobs.Spec("a", "x");
  auto refusal = [&](const std::function<void(JobSpec&)>& change) {
    JobSpec b = jobs.Spec("b", "x");
    change(b);
    return GroupRefusal(a, b, "cpu");
  };
  CHECK(refusal([](JobSpec&) {}).empty());
  CHECK_THAT(refusal([](JobSpec& b) { b.train.dtype = "bf16"; }),
             Catch::Contains("job b") && Catch::Contains("train.dtype"));
  CHECK_THAT(refusal([](JobSpec& b) { b.model.checkpoint = "/elsewhere"; }),
             Catch::Contains("model.checkpoint"));
  CHECK_THAT(refusal([](JobSpec& b) { b.stream.blocks_to_swap = 1; }),
             Catch::Contains("stream.blocks_to_swap"));
  // Through the trainer: the job leaves at once with its refusal, the group trains on.
  GroupTrainer group(a, jobs.Options());
  group.Add(GroupJob{a, {}, {}, {}});
  JobSpec b = jobs.Spec("b", "x");
  b.train.dtype = "bf16";
  group.Add(GroupJob{b, {}, {}, {}});
  CHECK(group.size() == 1);
  const std::vector<GroupJobOutcome> left = group.TakeLeft();
  REQUIRE(left.size() == 1);
  CHECK(left[0].error);
  group.Run();
  CHECK(!group.TakeLeft().at(0).error);
}

TEST_CASE("group: lorastream-worker train and plan take several job files", "[worker]") {
  testing::TempDir dir("group-cli");
  testing::MakeCheckpoint(dir / "m", "tiny");
  testing::WriteJsonl(dir / "d.jsonl", 4, 10, 30, 512);
  auto write_job = [&](const std::string& name, int seq_len, int rank, const std::string& more) {
    std::ofstream job(dir / (name + ".toml"));
    job << "name = \"" << name << "\"\n[model]\ncheckpoint = \"" << (dir / "m")
        << "\"\n[data]\npath = \"" << (dir / "d.jsonl") << "\"\nseq_len = " << seq_len
        << "\n[lora]\nrank = " << rank << "\n[train]\nsteps = 2\noutput_dir = \""
        << (dir / ("out-" + name)) << "\"\n"
        << more;
  };
  write_job("a", 16, 2, "");
  write_job("b", 24, 4, "");
  write_job("other", 16, 2, "[stream]\nblocks_to_swap = 1\n");  // another plan
  const std::string bin = std::string(LORASTREAM_BIN_DIR) + "/lorastream-worker";
  auto run = [&](const std::string& args, const std::string& log) {
    const std::string cmd = bin + " " + args + " > " + (dir / log) + " 2>&1";
    return std::system(cmd.c_str());
  };
  CHECK(run("train " + (dir / "a.toml") + " " + (dir / "b.toml") + " --threads 1", "log") == 0);
  const std::string log = testing::ReadFile(dir / "log");
  INFO(log);
  for (const char* line :
       {"a: step 2/2 loss ", "b: step 2/2 loss ", "a: done: 2 steps", "b: done: 2 steps"})
    CHECK(log.find(line) != std::string::npos);
  CHECK(std::filesystem::exists(dir / "out-a/adapter_model.safetensors"));
  CHECK(std::filesystem::exists(dir / "out-b/adapter_model.safetensors"));

  // A job of another plan leaves with its refusal; the group's exit status says a job failed.
  CHECK(run("train " + (dir / "a.toml") + " " + (dir / "other.toml") + " --threads 1 --no-resume",
            "log2") != 0);
  const std::string log2 = testing::ReadFile(dir / "log2");
  INFO(log2);
  CHECK(log2.find("other: failed: job other cannot train in a group with job a: "
                  "stream.blocks_to_swap differs") != std::string::npos);
  CHECK(log2.find("a: done: 2 steps") != std::string::npos);

  // plan: the group's estimate, and the refusal of a group beyond its budget.
  CHECK(run("plan " + (dir / "a.toml") + " " + (dir / "b.toml"), "plan") == 0);
  const std::string plan = testing::ReadFile(dir / "plan");
  INFO(plan);
  CHECK(plan.find("group of 2 jobs") != std::string::npos);
  CHECK(plan.find("job b: 24 tokens per micro-batch") != std::string::npos);
  CHECK(plan.find("(the group: every job's measured compute, the copies once; its memory)") !=
        std::string::npos);
  write_job("small", 16, 2, "[stream]\ngpu_memory_budget = \"1KiB\"\n");
  write_job("small2", 24, 4, "[stream]\ngpu_memory_budget = \"1KiB\"\n");
  CHECK(run("plan " + (dir / "small.toml") + " " + (dir / "small2.toml"), "plan2") != 0);
  const std::string plan2 = testing::ReadFile(dir / "plan2");
  INFO(plan2);
  CHECK(plan2.find("job small does not fit in the group") != std::string::npos);
  CHECK(plan2.find("more than the budget of") != std::string::npos);
}

TEST_CASE("group: a memory budget plans for the whole group while it trains", "[worker]") {
  testing::TempDir dir("group-budget");
  testing::MakeCheckpoint(dir / "m", "tiny");
  testing::WriteJsonl(dir / "d.jsonl", 4, 10, 30, 512);
  auto write_job = [&](const std::string& name, int seq_len, const std::string& budget) {
    std::ofstream job(dir / (name + ".toml"));
    job << "name = \"" << name << "\"\n[model]\ncheckpoint = \"" << (dir / "m")
        << "\"\n[data]\npath = \"" << (dir / "d.jsonl") << "\"\nseq_len = " << seq_len
        << "\n[lora]\nrank = 2\n[train]\nsteps = 2\noutput_dir = \"" << (dir / ("out-" + name))
        << "\"\n[stream]\ngpu_memory_budget = " << budget << "\n";
  };
  const std::string bin = std::string(LORASTREAM_BIN_DIR) + "/lorastream-worker";
  auto run = [&](const std::string& args, const std::string& log) {
    const std::string cmd = bin + " " + args + " > " + (dir / log) + " 2>&1";
    return std::system(cmd.c_str());
  };
  // The smallest plan's estimate for job a alone, from the refusal of a budget of 1 KiB.
  write_job("a", 16, "1024");
  CHECK(run("plan " + (dir / "a.toml") + " " + (dir / "a.toml"), "probe") != 0);
  const std::string probe = testing::ReadFile(dir / "probe");
  INFO(probe);
  const size_t at = probe.find(" bytes) more than the budget");
  REQUIRE(at != std::string::npos);
  const size_t open = probe.rfind('(', at);
  const uint64_t over = std::stoull(probe.substr(open + 1, at - open - 1));
  const std::string exact = std::to_string(over + 1024);  // a fits it alone, streamed

  write_job("a", 16, exact);
  write_job("b", 24, exact);
  CHECK(run("train " + (dir / "a.toml") + " --threads 1", "alone") == 0);
  INFO(testing::ReadFile(dir / "alone"));
  // Together they cannot fit: the group is planned for a alone, b cannot join it (named) and
  // trains after, alone, where it does not fit either.
  CHECK(run("train " + (dir / "a.toml") + " " + (dir / "b.toml") + " --threads 1 --no-resume",
            "group") != 0);
  const std::string group = testing::ReadFile(dir / "group");
  INFO(group);
  CHECK(group.find("job b does not fit in the group beside the 1 before it") != std::string::npos);
  CHECK(!std::filesystem::exists(dir / "out-b/adapter_model.safetensors"));
}
