// FLUX.1 job groups on the CPU: two jobs of different shapes (resolution, batch, rank, targets,
// timestep sampling, steps) trained as one group give each job's loss per step, adapters and
// checkpoints of the job trained alone, bit for bit, the one that ends earlier leaving while
// the other trains on; a streamed group equals a resident one and copies each unit once per
// step for both jobs; a job that cannot share the group is refused naming the key and the
// others train on; `lorastream-worker train A.toml B.toml` trains FLUX jobs as one group.
#include "tests/worker/torch_catch.h"

#include <filesystem>
#include <fstream>
#include <map>

#include "common/base/error.h"
#include "common/formats/flux_config.h"
#include "common/job/flux_job.h"
#include "common/job/job_spec.h"
#include "common/posix/subprocess.h"
#include "tests/support/flux_cache_files.h"
#include "tests/support/flux_checkpoint.h"
#include "tests/support/test_support.h"
#include "tests/worker/worker_test_util.h"
#include "worker/flux/flux_base.h"
#include "worker/flux/flux_calibrate.h"
#include "worker/flux/flux_checkpoint.h"
#include "worker/flux/flux_data.h"
#include "worker/flux/flux_group.h"
#include "worker/flux/flux_plan.h"
#include "worker/flux/flux_train.h"

using namespace lorastream;
using namespace lorastream::worker;
using namespace lorastream::worker::flux;
using lorastream::testing::ReadFile;
using lorastream::testing::TempDir;

namespace {

// DIR/model (flux-tiny); DIR/cache-a: "cat" and "dog" (32x32) and "wide" (48x32); DIR/cache-b:
// "big" (48x48) and "tall" (32x48).
void WriteModelAndCaches(const std::string& dir) {
  lorastream::testing::MakeFluxCheckpoint(dir + "/model");
  const FluxCacheShape shape = lorastream::testing::TinyCacheShape();
  std::filesystem::create_directories(dir + "/cache-a");
  std::filesystem::create_directories(dir + "/cache-b");
  lorastream::testing::WriteFluxCache(dir + "/cache-a", "cat", 32, 32, shape, 1);
  lorastream::testing::WriteFluxCache(dir + "/cache-a", "dog", 32, 32, shape, 2);
  lorastream::testing::WriteFluxCache(dir + "/cache-a", "wide", 48, 32, shape, 3);
  lorastream::testing::WriteFluxCache(dir + "/cache-b", "big", 48, 48, shape, 4);
  lorastream::testing::WriteFluxCache(dir + "/cache-b", "tall", 32, 48, shape, 5);
}

// Job A: 4 steps of 2 images, rank 4 on every layer, flux_shift, a checkpoint every 2 steps.
// Job B: 2 steps of 1 image, rank 8 on attention, sigmoid sampling, another seed and lr.
FluxJob JobA(const std::string& dir) {
  FluxJob j;
  j.checkpoint = dir + "/model/flux1.safetensors";
  j.cache_dir = dir + "/cache-a";
  j.steps = 4;
  j.batch_size = 2;
  j.seed = 7;
  j.rank = 4;
  j.alpha = 8;
  j.learning_rate = 1e-3;
  j.timestep_sampling = "flux_shift";
  j.save_every = 2;
  return j;
}

FluxJob JobB(const std::string& dir) {
  FluxJob j = JobA(dir);
  j.cache_dir = dir + "/cache-b";
  j.steps = 2;
  j.batch_size = 1;
  j.seed = 3;
  j.rank = 8;
  j.alpha = 4;
  j.targets = {"attention"};
  j.learning_rate = 2e-3;
  j.timestep_sampling = "sigmoid";
  j.save_every = 0;
  return j;
}

struct GroupRun {
  std::map<std::string, std::vector<StepStats>> steps;  // by job name
  std::vector<GroupJobOutcome> outcomes;
};

GroupRun TrainGroup(const std::vector<std::pair<std::string, FluxJob>>& jobs) {
  GroupRun run;
  std::vector<GroupJob> group;
  for (const auto& [name, job] : jobs) {
    GroupJob g;
    g.spec = FluxJobSpec(job, name);
    g.on_step = [&run, name = name](const StepStats& s) { run.steps[name].push_back(s); };
    group.push_back(std::move(g));
  }
  run.outcomes = RunFluxGroupTraining(std::move(group), {});
  return run;
}

void CheckSameAsAlone(const std::vector<StepStats>& got, const FluxTrainResult& alone,
                      const std::string& out_dir) {
  REQUIRE(got.size() == alone.steps.size());
  for (size_t i = 0; i < got.size(); ++i) {
    INFO("step " << i + 1);
    CHECK(got[i].loss == alone.steps[i].loss);
    CHECK(got[i].grad_norm == alone.steps[i].grad_norm);
    CHECK(got[i].tokens == alone.steps[i].tokens);
  }
  CHECK(ReadFile(out_dir + "/" + kKohyaAdapterFile) == ReadFile(alone.kohya_path));
  CHECK(ReadFile(out_dir + "/" + kDiffusersAdapterFile) == ReadFile(alone.diffusers_path));
  const std::string last = "/checkpoint-" + std::to_string(got.size());
  CHECK(ReadFile(out_dir + last + "/trainer_state.safetensors") ==
        ReadFile(std::filesystem::path(alone.kohya_path).parent_path().string() + last +
                 "/trainer_state.safetensors"));
}

}  // namespace

TEST_CASE(
    "flux group: two jobs of different shapes train as each does alone, bit for bit; streamed "
    "= resident, each unit copied once per step for both",
    "[worker][flux][group]") {
  TempDir dir("flux-group");
  const std::string d = dir.str();
  WriteModelAndCaches(d);
  FluxJob a = JobA(d), b = JobB(d);
  a.output_dir = d + "/alone-a";
  b.output_dir = d + "/alone-b";
  const FluxTrainResult alone_a = TrainFlux(a, {});
  const FluxTrainResult alone_b = TrainFlux(b, {});
  REQUIRE(alone_a.steps.size() == 4);
  REQUIRE(alone_b.steps.size() == 2);
  CHECK(alone_a.steps[0].tokens != alone_b.steps[0].tokens);

  SECTION("resident") {
    a.output_dir = d + "/group-a";
    b.output_dir = d + "/group-b";
    const GroupRun run = TrainGroup({{"a", a}, {"b", b}});
    REQUIRE(run.outcomes.size() == 2);
    for (const auto& out : run.outcomes) {
      CHECK(!out.error);
      CHECK(out.result.adapter_dir == (out.name == "a" ? a.output_dir : b.output_dir));
    }
    CheckSameAsAlone(run.steps.at("a"), alone_a, a.output_dir);
    CheckSameAsAlone(run.steps.at("b"), alone_b, b.output_dir);
    CHECK(std::filesystem::is_directory(a.output_dir + "/checkpoint-2"));
  }

  SECTION("streamed: three units through one slot") {
    for (FluxJob* j : {&a, &b}) {
      j->blocks_to_swap = 3;
      j->ring_size = 1;
    }
    a.output_dir = d + "/streamed-alone-a";
    const FluxTrainResult streamed_a = TrainFlux(a, {});
    a.output_dir = d + "/streamed-a";
    b.output_dir = d + "/streamed-b";
    const GroupRun run = TrainGroup({{"a", a}, {"b", b}});
    for (const auto& out : run.outcomes) CHECK(!out.error);
    CheckSameAsAlone(run.steps.at("a"), alone_a, a.output_dir);
    CheckSameAsAlone(run.steps.at("b"), alone_b, b.output_dir);
    // The group's steps copy what one job's steps copy, for both jobs; after B has left, A's
    // steps copy the same again.
    const auto& group_a = run.steps.at("a");
    for (size_t i = 0; i < group_a.size(); ++i) {
      INFO("step " << i + 1);
      CHECK(group_a[i].copies > 0);
      CHECK(group_a[i].h2d_bytes == streamed_a.steps[i].h2d_bytes);
      CHECK(group_a[i].copies == streamed_a.steps[i].copies);
    }
    CHECK(run.steps.at("b")[0].h2d_bytes == group_a[0].h2d_bytes);
  }
}

TEST_CASE(
    "flux group: a job that cannot share the group leaves with the reason, the others train; a "
    "stopped job leaves with its checkpoint and resumes in another group",
    "[worker][flux][group]") {
  TempDir dir("flux-group-refuse");
  const std::string d = dir.str();
  WriteModelAndCaches(d);
  FluxJob a = JobA(d), b = JobB(d);
  a.output_dir = d + "/a";
  b.output_dir = d + "/b";
  FluxJob bf16 = b;
  bf16.dtype = "bf16";
  bf16.output_dir = d + "/bf16";
  FluxJob swap = b;
  swap.blocks_to_swap = 2;
  swap.output_dir = d + "/swap";
  FluxJob missing = b;
  missing.cache_dir = d + "/no-such-cache";
  missing.output_dir = d + "/missing";
  JobSpec llm;
  llm.name = "llm";
  llm.model.checkpoint = d + "/model";

  FluxGroupTrainer group(FluxJobSpec(a, "a"), {});
  int steps_a = 0;
  GroupJob ja{FluxJobSpec(a, "a"), [&steps_a](const StepStats&) { ++steps_a; },
              [&steps_a] { return steps_a >= 2; }, ""};
  group.Add(std::move(ja));
  group.Add(GroupJob{FluxJobSpec(bf16, "bf16"), {}, {}, ""});
  group.Add(GroupJob{FluxJobSpec(swap, "swap"), {}, {}, ""});
  group.Add(GroupJob{FluxJobSpec(missing, "missing"), {}, {}, ""});
  group.Add(GroupJob{llm, {}, {}, ""});
  group.Add(GroupJob{FluxJobSpec(b, "b"), {}, {}, ""});
  std::map<std::string, std::string> errors;
  for (const auto& out : group.TakeLeft()) {
    REQUIRE(out.error);
    errors[out.name] =
        lorastream::testing::ErrorMessageOf([&] { std::rethrow_exception(out.error); });
  }
  CHECK_THAT(errors["bf16"], Catch::Contains("job bf16 cannot train in a group with job a") &&
                                 Catch::Contains("flux.dtype differs"));
  CHECK_THAT(errors["swap"], Catch::Contains("flux.blocks_to_swap differs"));
  CHECK_THAT(errors["missing"], Catch::Contains("no-such-cache"));
  CHECK_THAT(errors["llm"],
             Catch::Contains("FLUX.1 jobs share a group only with FLUX.1 jobs on their base"));
  CHECK(group.size() == 2);
  group.Run();
  std::map<std::string, GroupJobOutcome> left;
  for (auto& out : group.TakeLeft()) left[out.name] = out;
  REQUIRE(left.size() == 2);
  CHECK(!left["b"].error);
  CHECK(left["b"].result.steps_done == 2);
  // A was asked to stop after its second step: its checkpoint is checkpoint-2.
  CHECK(!left["a"].error);
  CHECK(left["a"].result.stopped);
  CHECK(left["a"].result.steps_done == 2);
  CHECK(std::filesystem::path(left["a"].result.checkpoint_dir).filename() == "checkpoint-2");

  // Given together from the start (the group planned for both, no budget), a job whose caches
  // cannot be read fails alone, naming them, and the other trains.
  FluxJob a2 = a;
  a2.output_dir = d + "/a2";
  const std::vector<GroupJobOutcome> given =
      RunFluxGroupTraining({GroupJob{FluxJobSpec(a2, "a2"), {}, {}, ""},
                            GroupJob{FluxJobSpec(missing, "missing"), {}, {}, ""}},
                           {});
  REQUIRE(given.size() == 2);
  CHECK(!given[0].error);
  REQUIRE(given[1].error);
  CHECK_THAT(lorastream::testing::ErrorMessageOf([&] { std::rethrow_exception(given[1].error); }),
             Catch::Contains("no-such-cache"));

  // Resumed alone, it ends as the uninterrupted job does.
  const FluxTrainResult resumed = TrainFlux(a, {});
  CHECK(resumed.first_step == 2);
  a.output_dir = d + "/uninterrupted";
  const FluxTrainResult full = TrainFlux(a, {});
  REQUIRE(resumed.steps.size() == 2);
  CHECK(resumed.steps[1].loss == full.steps[3].loss);
  CHECK(ReadFile(resumed.kohya_path) == ReadFile(full.kohya_path));
}

TEST_CASE(
    "lorastream-worker train and plan A.toml B.toml: FLUX jobs as one group; FLUX with LLM "
    "refused",
    "[worker][flux][group]") {
  TempDir dir("flux-group-cmd");
  const std::string d = dir.str();
  WriteModelAndCaches(d);
  FluxJob a = JobA(d), b = JobB(d);
  a.output_dir = d + "/out-a";
  b.output_dir = d + "/out-b";
  std::ofstream(d + "/a.toml") << "name = \"job-a\"\n" << FluxJobToToml(a);
  std::ofstream(d + "/b.toml") << "name = \"job-b\"\n" << FluxJobToToml(b);
  std::ofstream(d + "/llm.toml") << "[model]\ncheckpoint = \"model\"\n";
  const std::string bin = std::string(LORASTREAM_BIN_DIR) + "/lorastream-worker";
  int code = -1;
  const std::string out = RunAndCapture(
      {bin, "train", d + "/a.toml", d + "/b.toml", "--device", "cpu"}, &code, 120, d + "/log");
  INFO(out << ReadFile(d + "/log"));
  CHECK(code == 0);
  CHECK_THAT(out, Catch::Contains("job-a: done: steps 1..4") &&
                      Catch::Contains("job-b: done: steps 1..2"));
  CHECK_THAT(ReadFile(d + "/log"), Catch::Contains("joins the FLUX group (2 jobs)"));
  CHECK(std::filesystem::exists(d + "/out-b/" + kKohyaAdapterFile));
  RunAndCapture({bin, "train", d + "/a.toml", d + "/llm.toml", "--device", "cpu"}, &code, 60,
                d + "/log2");
  CHECK(code != 0);
  CHECK_THAT(ReadFile(d + "/log2"), Catch::Contains("is not a FLUX job"));
  // `plan` on both: the group's table.
  const std::string table = RunAndCapture(
      {bin, "plan", d + "/a.toml", d + "/b.toml", "--device", "cpu"}, &code, 120, d + "/log3");
  CHECK(code == 0);
  CHECK_THAT(table, Catch::Contains("a group of 2 FLUX jobs (job-a and 1 more)") &&
                        Catch::Contains("chosen: swap 0"));
  RunAndCapture({bin, "plan", d + "/a.toml", d + "/llm.toml", "--device", "cpu"}, &code, 60,
                d + "/log4");
  CHECK(code != 0);
  CHECK_THAT(ReadFile(d + "/log4"), Catch::Contains("FLUX.1 jobs share a group only with FLUX.1"));
}

TEST_CASE(
    "flux group: a budget plans for every job's activations; a group beyond it is refused naming "
    "the job and by how much",
    "[worker][flux][group]") {
  TempDir dir("flux-group-budget");
  const std::string d = dir.str();
  WriteModelAndCaches(d);
  FluxJob a = JobA(d), b = JobB(d);
  const FluxBase base = FluxBase::Load(a.checkpoint, 2, at::kFloat, at::kCPU);
  const FluxDataset data_a(a.cache_dir, base.config()), data_b(b.cache_dir, base.config());
  const FluxMemoryInputs in_a = FluxMemoryInputsFor(base, a, data_a, at::kCPU, at::kFloat);
  const FluxMemoryInputs in_b = FluxMemoryInputsFor(base, b, data_b, at::kCPU, at::kFloat);
  FluxMemoryInputs group = in_a;
  group.group.push_back({"b", in_b.lora_params, in_b.batch, in_b.image_tokens, in_b.text_tokens});
  const ResidencyPlan smallest = FluxResidency(in_a, 2, 2, 1);
  const FluxMemoryEstimate alone = EstimateFluxMemory(in_a, smallest);
  const FluxMemoryEstimate both = EstimateFluxMemory(group, smallest);
  const FluxMemoryEstimate only_b = EstimateFluxMemory(in_b, smallest);
  // The weights and ring once; each job's adapter; the larger working set.
  CHECK(both.ring == alone.ring);
  CHECK(both.adapter == alone.adapter + only_b.adapter);
  CHECK(both.checkpoints > alone.checkpoints + only_b.checkpoints);
  CHECK(both.backward_working == std::max(alone.backward_working, only_b.backward_working));
  CHECK(both.total() > alone.total());

  // A budget between the two: A alone fits, the group does not, and B is named.
  const uint64_t budget = (alone.total() + both.total()) / 2;
  CHECK(FluxGroupBudgetRefusal(in_a, budget, "a").empty());
  const std::string why = FluxGroupBudgetRefusal(group, budget, "a");
  CHECK_THAT(why, Catch::Contains("job b does not fit in the FLUX group beside the 1 before it") &&
                      Catch::Contains(std::to_string(both.total() - budget) + " bytes) more"));
  for (FluxJob* j : {&a, &b}) j->gpu_memory_budget = budget;
  {
    // A serving worker asks for each waiting job at every step: a job's caches are read once,
    // so the answer stands with them gone.
    FluxJob first = a;
    first.output_dir = d + "/join-a";
    FluxGroupTrainer group(FluxJobSpec(first, "a"), {});
    const std::string refused = group.JoinRefusal(FluxJobSpec(b, "b"));
    CHECK_THAT(refused, Catch::Contains("job b does not fit"));
    std::filesystem::rename(d + "/cache-b", d + "/cache-b-away");
    CHECK(group.JoinRefusal(FluxJobSpec(b, "b")) == refused);
    std::filesystem::rename(d + "/cache-b-away", d + "/cache-b");
  }
  a.output_dir = d + "/a";
  b.output_dir = d + "/b";
  // Trained together, the group is planned for a alone; b, which does not fit beside it but
  // fits alone, trains after it (neither is refused).
  const std::vector<GroupJobOutcome> apart = RunFluxGroupTraining(
      {GroupJob{FluxJobSpec(a, "a"), {}, {}, ""}, GroupJob{FluxJobSpec(b, "b"), {}, {}, ""}}, {});
  REQUIRE(apart.size() == 2);
  CHECK((apart[0].name == "a" && !apart[0].error));
  CHECK((apart[1].name == "b" && !apart[1].error));
  // Within a budget the group fits (some units streamed), each job trains as alone.
  for (FluxJob* j : {&a, &b}) j->gpu_memory_budget = both.total() + 1;
  a.output_dir = d + "/alone-a";
  const FluxTrainResult alone_a = TrainFlux(a, {});
  a.output_dir = d + "/group-a";
  const GroupRun run = TrainGroup({{"a", a}, {"b", b}});
  for (const auto& out : run.outcomes) CHECK(!out.error);
  CheckSameAsAlone(run.steps.at("a"), alone_a, a.output_dir);
  CHECK(run.steps.at("a")[0].copies > 0);
}

TEST_CASE(
    "flux group: a stop asked by every job inside a step ends it between two units; each job "
    "keeps its last completed step",
    "[worker][flux][group]") {
  TempDir dir("flux-group-stop");
  const std::string d = dir.str();
  WriteModelAndCaches(d);
  FluxJob a = JobA(d), b = JobB(d);
  a.output_dir = d + "/a";
  b.output_dir = d + "/b";
  b.steps = 4;
  // Each job is asked at every step boundary, at its step's end, and the group before every
  // unit it acquires: from the 13th question on, in the second step's forward, both say stop.
  int questions = 0;
  auto stop = [&questions] { return ++questions >= 13; };
  std::vector<StepStats> steps_a;
  std::vector<GroupJob> jobs;
  jobs.push_back(
      GroupJob{FluxJobSpec(a, "a"), [&](const StepStats& s) { steps_a.push_back(s); }, stop, ""});
  jobs.push_back(GroupJob{FluxJobSpec(b, "b"), {}, [&questions] { return questions >= 13; }, ""});
  for (const GroupJobOutcome& out : RunFluxGroupTraining(std::move(jobs), {})) {
    INFO(out.name);
    CHECK(!out.error);
    CHECK(out.result.stopped);
    CHECK(out.result.steps_done == 1);
    CHECK(std::filesystem::path(out.result.checkpoint_dir).filename() == "checkpoint-1");
  }
  CHECK(steps_a.size() == 1);
  // Resumed alone, A ends as the uninterrupted job does.
  const FluxTrainResult resumed = TrainFlux(a, {});
  CHECK(resumed.first_step == 1);
  a.output_dir = d + "/uninterrupted";
  const FluxTrainResult full = TrainFlux(a, {});
  CHECK(ReadFile(resumed.kohya_path) == ReadFile(full.kohya_path));
}

TEST_CASE("the FLUX planner's budget refusal names the job's keys as its file writes them",
          "[worker][flux]") {
  FluxMemoryInputs in;
  in.config = FluxConfig{};  // FLUX.1-dev
  in.units = FluxUnits(in.config, 2);
  in.unit_bytes.assign(in.units.size(), uint64_t{1} << 30);
  in.image_tokens = 4096;
  in.text_tokens = 512;
  StepCosts costs;
  costs.block_forward_seconds = 0.005;
  costs.block_backward_seconds = 0.015;
  costs.h2d_bytes_per_second = 50e9;
  costs.block_scale.assign(in.units.size(), 1.0);
  FluxJob legacy;
  FluxJob shared;
  shared.shared_form = true;
  CHECK(FluxJobMemoryModel(in, legacy).budget_key == "flux.gpu_memory_budget");
  CHECK(FluxJobMemoryModel(in, legacy).batch_key == "flux.batch_size");
  CHECK_THROWS_WITH(
      ChooseDitPlan(FluxJobMemoryModel(in, shared), FluxDitJob(in), {}, costs, uint64_t{1} << 30),
      Catch::Contains("stream.gpu_memory_budget 1") && Catch::Contains("lower train.batch_size"));
}
