// Qwen-Image as a family of the one trainer, on the CPU: a job file with a [qwen_image]
// section trains through RunGroupTraining and `lorastream-worker train`; streamed equals
// resident, a group of two jobs of different shapes equals each alone, a stopped job resumed
// equals the uninterrupted one (all bit for bit); `plan` shows its blocks; a Qwen-Image job
// shares a group with no other family. On a store (model.store): equal to the checkpoint's
// run bit for bit, fp8/nf4 stores close to it, stores of other families or dtypes refused.
#include "tests/worker/torch_catch.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>

#include "common/base/device.h"
#include "common/base/dtype.h"
#include "common/base/error.h"
#include "common/base/format_bytes.h"
#include "common/formats/qwen_image_cache.h"
#include "common/formats/qwen_image_config.h"
#include "common/formats/qwen_image_layout.h"
#include "common/job/job_group.h"
#include "common/job/job_spec.h"
#include "common/posix/subprocess.h"
#include "store/attach.h"
#include "store/server.h"
#include "tests/support/flux_cache_files.h"
#include "tests/support/flux_checkpoint.h"
#include "tests/support/test_support.h"
#include "tests/worker/worker_test_util.h"
#include "worker/flux/flux_base.h"
#include "worker/model/base_weights.h"
#include "worker/qwen_image/qwen_image_adapter_io.h"
#include "worker/qwen_image/qwen_image_base.h"
#include "worker/qwen_image/qwen_image_calibrate.h"
#include "worker/train/family.h"
#include "worker/train/group_trainer.h"

using namespace lorastream;
using namespace lorastream::worker;
using lorastream::testing::ReadFile;
using lorastream::testing::TempDir;

namespace {

const std::string kModel =
    std::string(LORASTREAM_SOURCE_DIR) + "/tests/fixtures/qwen_image/qi_l2_model.safetensors";

// DIR/cache-a: "cat" and "dog" (32x32; captions of 5 and 3 tokens) and "wide" (48x32);
// DIR/cache-b: "big" (48x48) and "tall" (32x48).
void WriteCaches(const std::string& dir) {
  const int64_t jd = QwenImageCheckpointReader::Open(kModel).config().joint_attention_dim;
  std::filesystem::create_directories(dir + "/cache-a");
  std::filesystem::create_directories(dir + "/cache-b");
  WriteQwenImageCacheFiles(dir + "/cache-a", "cat", 32, 32, 5, jd, 1);
  WriteQwenImageCacheFiles(dir + "/cache-a", "dog", 32, 32, 3, jd, 2);
  WriteQwenImageCacheFiles(dir + "/cache-a", "wide", 48, 32, 4, jd, 3);
  WriteQwenImageCacheFiles(dir + "/cache-b", "big", 48, 48, 6, jd, 4);
  WriteQwenImageCacheFiles(dir + "/cache-b", "tall", 32, 48, 2, jd, 5);
}

// Job A: 4 steps of 2 images, rank 4 on musubi-tuner's default targets, shift sampling, a
// checkpoint every 2 steps. Job B: 2 steps of 1 image, rank 8 on attention, qwen_shift,
// another seed and learning rate.
std::string JobA(const std::string& dir, const std::string& out, const std::string& stream = "") {
  return "name = \"a\"\n[model]\ncheckpoint = \"" + kModel +
         "\"\n[lora]\nrank = 4\nalpha = 8.0\n[optim]\nlr = 1e-3\n[train]\nsteps = 4\n"
         "batch_size = 2\nseed = 7\ncheckpoint_every = 2\noutput_dir = \"" +
         out + "\"\n" + stream + "[qwen_image]\ncache_dir = \"" + dir + "/cache-a\"\n";
}

std::string JobB(const std::string& dir, const std::string& out, const std::string& stream = "") {
  return "name = \"b\"\n[model]\ncheckpoint = \"" + kModel +
         "\"\n[lora]\nrank = 8\nalpha = 4.0\ntargets = [\"attention\"]\n[optim]\nlr = 2e-3\n"
         "[train]\nsteps = 2\nseed = 3\noutput_dir = \"" +
         out + "\"\n" + stream + "[qwen_image]\ncache_dir = \"" + dir +
         "/cache-b\"\ntimestep_sampling = \"qwen_shift\"\n";
}

// A job's text with its [model] naming store `name` instead of the checkpoint.
std::string OnStore(std::string text, const std::string& name) {
  const std::string from = "checkpoint = \"" + kModel + "\"";
  text.replace(text.find(from), from.size(), "store = \"" + name + "\"");
  return text;
}

JobSpec Spec(const std::string& text) {
  JobSpec s = ParseJobSpec(text, "job.toml");
  ResolveJobSpec(s);
  RequireValidJobSpec(s);
  return s;
}

struct Run {
  std::map<std::string, std::vector<StepStats>> steps;  // by job name
  std::vector<GroupJobOutcome> outcomes;
};

Run Train(const std::vector<std::string>& texts, std::function<bool()> stop = {},
          std::function<void()> each_step = {}) {
  Run run;
  std::vector<GroupJob> jobs;
  for (const std::string& text : texts) {
    GroupJob g;
    g.spec = Spec(text);
    g.on_step = [&run, each_step, name = g.spec.name](const StepStats& s) {
      run.steps[name].push_back(s);
      if (each_step) each_step();
    };
    g.should_stop = stop;
    jobs.push_back(std::move(g));
  }
  TrainOptions options;
  options.device = "cpu";
  run.outcomes = RunGroupTraining(std::move(jobs), options);
  for (const GroupJobOutcome& out : run.outcomes) {
    INFO(out.name);
    if (out.error) std::rethrow_exception(out.error);
  }
  return run;
}

void CheckSame(const std::vector<StepStats>& got, const std::vector<StepStats>& want,
               const std::string& got_dir, const std::string& want_dir) {
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    INFO("step " << i + 1);
    CHECK(got[i].loss == want[i].loss);
    CHECK(got[i].grad_norm == want[i].grad_norm);
    CHECK(got[i].tokens == want[i].tokens);
  }
  for (const char* file : {qwen_image::kComfyAdapterFile, qwen_image::kQwenDiffusersAdapterFile})
    CHECK(ReadFile(got_dir + "/" + file) == ReadFile(want_dir + "/" + file));
}

}  // namespace

TEST_CASE(
    "qwen_image job: trains through the one trainer; streamed = resident, a group of two = each "
    "alone, resumed = uninterrupted, bit for bit",
    "[worker][qwen_image][group]") {
  TempDir dir("qwen-image-job");
  const std::string d = dir.str();
  WriteCaches(d);
  CHECK(FamilyName(Spec(JobA(d, d + "/x"))) == "Qwen-Image");
  const Run alone_a = Train({JobA(d, d + "/alone-a")});
  const Run alone_b = Train({JobB(d, d + "/alone-b")});
  const std::vector<StepStats>& sa = alone_a.steps.at("a");
  REQUIRE(sa.size() == 4);
  REQUIRE(alone_b.steps.at("b").size() == 2);
  for (const StepStats& s : sa) CHECK(std::isfinite(s.loss));
  CHECK(sa[0].tokens != alone_b.steps.at("b")[0].tokens);
  CHECK(alone_a.outcomes[0].result.steps_done == 4);
  CHECK_THAT(alone_a.outcomes[0].result.done_line,
             Catch::Contains("adapter (ComfyUI): " + d + "/alone-a/adapter_comfyui.safetensors"));
  CHECK(std::filesystem::is_directory(d + "/alone-a/checkpoint-2"));
  CHECK(std::filesystem::exists(d + "/alone-a/stats.jsonl"));

  SECTION("streamed: both blocks through one slot") {
    const std::string stream = "[stream]\nblocks_to_swap = 2\nring_size = 1\n";
    const Run streamed = Train({JobA(d, d + "/streamed-a", stream)});
    CheckSame(streamed.steps.at("a"), sa, d + "/streamed-a", d + "/alone-a");
    CHECK(streamed.steps.at("a")[0].h2d_bytes > 0);
    CHECK(sa[0].h2d_bytes == 0);
  }
  SECTION("taped: every block, or one beside a streamed one (stream.taped_blocks)") {
    const Run taped = Train({JobA(d, d + "/taped-a", "[stream]\ntaped_blocks = 2\n")});
    CheckSame(taped.steps.at("a"), sa, d + "/taped-a", d + "/alone-a");
    const Run beside =
        Train({JobA(d, d + "/beside-a", "[stream]\nblocks_to_swap = 1\ntaped_blocks = 1\n")});
    CheckSame(beside.steps.at("a"), sa, d + "/beside-a", d + "/alone-a");
    CHECK(beside.steps.at("a")[0].h2d_bytes > 0);
  }
  SECTION("a group of two, every block taped") {
    const std::string stream = "[stream]\ntaped_blocks = 2\n";
    const Run group = Train({JobA(d, d + "/gtaped-a", stream), JobB(d, d + "/gtaped-b", stream)});
    CheckSame(group.steps.at("a"), sa, d + "/gtaped-a", d + "/alone-a");
    CheckSame(group.steps.at("b"), alone_b.steps.at("b"), d + "/gtaped-b", d + "/alone-b");
  }
  SECTION("a group of two, B leaving after its second step") {
    const Run group = Train({JobA(d, d + "/group-a"), JobB(d, d + "/group-b")});
    CheckSame(group.steps.at("a"), sa, d + "/group-a", d + "/alone-a");
    CheckSame(group.steps.at("b"), alone_b.steps.at("b"), d + "/group-b", d + "/alone-b");
  }
  SECTION("stopped after step 2, then resumed") {
    int steps = 0;
    const Run stopped = Train(
        {JobA(d, d + "/resumed-a")}, [&steps] { return steps >= 2; }, [&steps] { ++steps; });
    CHECK(stopped.outcomes[0].result.stopped);
    CHECK(stopped.outcomes[0].result.steps_done == 2);
    const Run resumed = Train({JobA(d, d + "/resumed-a")});
    CHECK(resumed.outcomes[0].result.start_step == 2);
    const std::vector<StepStats>& sr = resumed.steps.at("a");
    REQUIRE(sr.size() == 2);
    CHECK(sr[0].loss == sa[2].loss);
    CHECK(sr[1].loss == sa[3].loss);
    for (const char* file : {qwen_image::kComfyAdapterFile, qwen_image::kQwenDiffusersAdapterFile})
      CHECK(ReadFile(d + "/resumed-a/" + file) == ReadFile(d + "/alone-a/" + file));
  }
}

TEST_CASE(
    "lorastream-worker train and plan of Qwen-Image job files; a Qwen-Image job shares a group "
    "with no other family",
    "[worker][qwen_image][group]") {
  TempDir dir("qwen-image-cmd");
  const std::string d = dir.str();
  WriteCaches(d);
  std::ofstream(d + "/a.toml") << JobA(d, "out-a", "[stream]\nblocks_to_swap = 1\n");
  std::ofstream(d + "/b.toml") << JobB(d, "out-b", "[stream]\nblocks_to_swap = 1\n");
  std::ofstream(d + "/llm.toml") << "[model]\ncheckpoint = \"model\"\n";
  const std::string bin = std::string(LORASTREAM_BIN_DIR) + "/lorastream-worker";
  int code = -1;
  const std::string out = RunAndCapture(
      {bin, "train", d + "/a.toml", d + "/b.toml", "--device", "cpu"}, &code, 120, d + "/log");
  INFO(out << ReadFile(d + "/log"));
  CHECK(code == 0);
  CHECK_THAT(out, Catch::Contains("a: done: steps 1..4") && Catch::Contains("b: done: steps 1..2"));
  CHECK_THAT(ReadFile(d + "/log"), Catch::Contains("joins the Qwen-Image group (2 jobs)"));
  CHECK(std::filesystem::exists(d + "/out-b/" + qwen_image::kComfyAdapterFile));
  RunAndCapture({bin, "train", d + "/a.toml", d + "/llm.toml", "--device", "cpu"}, &code, 60,
                d + "/log2");
  CHECK(code != 0);
  CHECK_THAT(ReadFile(d + "/log2"), Catch::Contains("is not a Qwen-Image job"));
  const std::string plan =
      RunAndCapture({bin, "plan", d + "/a.toml", "--device", "cpu"}, &code, 60, d + "/log3");
  INFO(plan << ReadFile(d + "/log3"));
  CHECK(code == 0);
  CHECK_THAT(plan, Catch::Contains("job a: Qwen-Image, 2 blocks of") &&
                       Catch::Contains("1 streamed through 1 slots") &&
                       Catch::Contains("no budget: the job's plan") &&
                       Catch::Contains("chosen: swap 1 ring 1") &&
                       Catch::Contains("estimate: rest ") && Catch::Contains("+ checkpoints "));
  // A taped block: in the plan's label, its summary and its estimate.
  std::ofstream(d + "/t.toml") << JobA(d, "out-t",
                                       "[stream]\nblocks_to_swap = 1\ntaped_blocks = 1\n");
  const std::string taped =
      RunAndCapture({bin, "plan", d + "/t.toml", "--device", "cpu"}, &code, 60, d + "/log4");
  INFO(taped << ReadFile(d + "/log4"));
  CHECK(code == 0);
  CHECK_THAT(taped, Catch::Contains("chosen: swap 1 ring 1 taped 1") &&
                        Catch::Contains("taped=1") &&
                        Catch::Contains("activations of 1 taped unit "));
  // The coordinator's rule: another family never joins.
  JobSpec llm;
  llm.name = "llm";
  llm.model.checkpoint = d + "/model";
  CHECK_THAT(GroupRefusal(Spec(JobA(d, d + "/x")), llm, "cpu"),
             Catch::Contains("Qwen-Image jobs share a group only with Qwen-Image jobs"));
  CHECK(GroupRefusal(Spec(JobA(d, d + "/x")), Spec(JobB(d, d + "/y")), "cpu").empty());
}

TEST_CASE(
    "qwen_image job: lora.init_from starts from a ComfyUI file (its rank, alpha and targets); "
    "with lr 0 the adapter comes out as it went in, bit for bit; a shape that differs is refused",
    "[worker][qwen_image]") {
  TempDir dir("qwen-image-init-from");
  const std::string d = dir.str();
  WriteCaches(d);
  Train({JobA(d, d + "/a")});
  const std::string from =
      "name = \"c\"\n[model]\ncheckpoint = \"" + kModel + "\"\n[lora]\ninit_from = \"" + d +
      "/a\"\n[optim]\nlr = 0.0\n[train]\nsteps = 2\nseed = 9\noutput_dir = \"" + d +
      "/c\"\n[qwen_image]\ncache_dir = \"" + d + "/cache-b\"\n";
  const Run c = Train({from});
  CHECK(c.outcomes[0].result.steps_done == 2);
  CHECK(ReadFile(d + "/c/" + qwen_image::kComfyAdapterFile) ==
        ReadFile(d + "/a/" + qwen_image::kComfyAdapterFile));
  std::string other = from;
  other.replace(other.find("[lora]\n"), 7, "[lora]\nrank = 8\ntargets = [\"attention\"]\n");
  other.replace(other.find(d + "/c\""), d.size() + 3, d + "/c2\"");
  const std::string why = lorastream::testing::ErrorMessageOf([&] { Train({other}); });
  CHECK_THAT(why, Catch::Contains("lora.rank is 8 but the file lora.init_from names (" + d + "/a/" +
                                  qwen_image::kComfyAdapterFile + ") has rank 4") &&
                      Catch::Contains("lora.targets is [attn.add_k_proj"));
  JobSpec missing = ParseJobSpec(from, "j.toml");
  missing.lora.init_from = d + "/nothing";
  CHECK_THAT(ValidateJobSpec(missing).front(),
             Catch::Contains("key `lora.init_from` names neither a ComfyUI LoRA file"));
}

namespace {

// The planning of a job file's text on the CPU, as its group makes it.
qwen_image::QwenImagePlanning PlanOnCpu(const std::string& text) {
  const JobSpec spec = Spec(text);
  const QwenImageCheckpointReader source = QwenImageCheckpointReader::Open(spec.model.checkpoint);
  const DType dtype = ComputeDType(spec.train.dtype, ParseDevice("cpu"));
  return qwen_image::PlanQwenImageJob(
      source.config(), QwenImageManifest(source.config(), dtype, Manifest{}.alignment), spec, {},
      at::kCPU, ScalarTypeOf(dtype, "train.dtype"), /*predict=*/true);
}

}  // namespace

TEST_CASE(
    "qwen_image job: planned from stream.gpu_memory_budget it trains as the plan's blocks_to_swap "
    "written by hand, bit for bit; a budget below the smallest plan is refused; a joiner beyond "
    "the budget waits",
    "[worker][qwen_image][group]") {
  TempDir dir("qwen-image-budget");
  const std::string d = dir.str();
  WriteCaches(d);
  // Every block resident: its estimate; one byte less streams blocks.
  const qwen_image::QwenImagePlanning resident = PlanOnCpu(JobA(d, d + "/x"));
  REQUIRE(resident.plan.num_streamed() == 0);
  const uint64_t peak = resident.choice.candidates.front().peak_bytes;
  INFO(DescribeQwenImagePlanning(resident));
  CHECK(peak == qwen_image::EstimateQwenImageMemory(resident.inputs, resident.plan).total());
  // cache-a: 48x32 pixels the largest bucket (3 x 2 tokens), 5 tokens the longest caption.
  CHECK(resident.inputs.job.image_tokens == 6);
  CHECK(resident.inputs.job.text_tokens == 5);
  CHECK(resident.inputs.job.batch == 2);
  const std::string budget = "[stream]\ngpu_memory_budget = " + std::to_string(peak - 1) + "\n";
  const qwen_image::QwenImagePlanning planned = PlanOnCpu(JobA(d, d + "/x", budget));
  CHECK(planned.budget == peak - 1);
  const ResidencyPlan& plan = planned.plan;
  REQUIRE(plan.num_streamed() > 0);
  CHECK(planned.choice.candidates[planned.choice.chosen].peak_bytes <= peak - 1);

  const Run by_budget = Train({JobA(d, d + "/budget-a", budget)});
  const Run by_hand =
      Train({JobA(d, d + "/hand-a",
                  "[stream]\nblocks_to_swap = " + std::to_string(plan.num_streamed()) +
                      "\nring_size = " + std::to_string(plan.ring_size) + "\n")});
  CheckSame(by_budget.steps.at("a"), by_hand.steps.at("a"), d + "/budget-a", d + "/hand-a");
  CHECK(by_budget.steps.at("a")[0].h2d_bytes > 0);
  CHECK(by_budget.steps.at("a")[0].h2d_bytes == by_hand.steps.at("a")[0].h2d_bytes);

  // Below every block streamed through one slot: refused naming the key and the minimum.
  const uint64_t minimum =
      qwen_image::EstimateQwenImageMemory(
          planned.inputs, DitSmallestPlan(qwen_image::QwenImageMemoryModel(planned.inputs)))
          .total();
  const std::string small = "[stream]\ngpu_memory_budget = " + std::to_string(minimum - 1) + "\n";
  CHECK_THAT(lorastream::testing::ErrorMessageOf([&] { Train({JobA(d, d + "/small", small)}); }),
             Catch::Contains("stream.gpu_memory_budget " + FormatBytes(minimum - 1) +
                             " is below the smallest plan's estimate") &&
                 Catch::Contains(FormatBytes(minimum)));

  // A group planned for A within A's minimum (every block streamed): B does not fit beside it
  // and waits, naming the figures; within a budget that holds both, and without a budget, it
  // joins.
  TrainOptions options;
  options.device = "cpu";
  const std::string tight = "[stream]\ngpu_memory_budget = " + std::to_string(minimum) + "\n";
  const JobSpec b = Spec(JobB(d, d + "/b", tight));
  {
    const auto group =
        MakeFamilyGroup(Spec(JobA(d, d + "/ga", tight)), options, [] { return false; });
    const std::string why = group->JoinRefusal({b});
    CHECK_THAT(why, Catch::Contains("job b does not fit beside the group's 1 job(s)") &&
                        Catch::Contains("exceeds the plan's budget (stream.gpu_memory_budget), " +
                                        FormatBytes(minimum)));
  }
  {
    const std::string roomy = "[stream]\ngpu_memory_budget = \"64GiB\"\n";
    const auto group =
        MakeFamilyGroup(Spec(JobA(d, d + "/gr", roomy)), options, [] { return false; });
    CHECK(group->JoinRefusal({b}).empty());
  }
  {
    const auto group = MakeFamilyGroup(Spec(JobA(d, d + "/gn", "[stream]\nblocks_to_swap = 1\n")),
                                       options, [] { return false; });
    CHECK(group->JoinRefusal({b}).empty());
  }
}

TEST_CASE(
    "qwen_image job on a store trains as on the checkpoint, bit for bit, resident and streamed; "
    "its blocks are the store's read-only bytes",
    "[worker][qwen_image][store]") {
  TempDir dir("qwen-image-store-job");
  const std::string d = dir.str();
  WriteCaches(d);
  const auto published = lorastream::testing::ServeForTest(kModel, QuantMethod::kNone, "qi-job");
  const std::string name = published->manifest().store_name;
  CHECK(ValidateJobSpec(ParseJobSpec(OnStore(JobA(d, d + "/x"), name), "job.toml")).empty());

  const Run checkpoint = Train({JobA(d, d + "/checkpoint")});
  const Run resident = Train({OnStore(JobA(d, d + "/resident"), name)});
  CheckSame(resident.steps.at("a"), checkpoint.steps.at("a"), d + "/resident", d + "/checkpoint");
  const std::string stream = "[stream]\nblocks_to_swap = 2\nring_size = 1\n";
  const Run streamed = Train({OnStore(JobA(d, d + "/streamed", stream), name)});
  CheckSame(streamed.steps.at("a"), checkpoint.steps.at("a"), d + "/streamed", d + "/checkpoint");
  CHECK(streamed.steps.at("a")[0].h2d_bytes > 0);

  // The units are the store's mapping, the bytes the worker packs from the checkpoint itself.
  const qwen_image::QwenImageBase packed =
      qwen_image::QwenImageBase::Load(kModel, at::kFloat, at::kCPU);
  const qwen_image::QwenImageBase served =
      qwen_image::QwenImageBase::FromStore(name, at::kFloat, at::kCPU);
  const store::AttachedStore attached = store::AttachedStore::Attach(name);
  REQUIRE(served.unit_bytes().size() == packed.unit_bytes().size());
  for (size_t u = 0; u < packed.unit_bytes().size(); ++u) {
    CHECK(std::memcmp(served.unit_bytes()[u], attached.block_data(static_cast<int>(u)),
                      attached.block_size(static_cast<int>(u))) == 0);
    CHECK(std::memcmp(served.unit_bytes()[u], packed.unit_bytes()[u], packed.layouts()[u].nbytes) ==
          0);
  }
  for (const auto& [tensor, t] : packed.rest()) CHECK(at::equal(t, served.rest().at(tensor)));
  // Read-only: a write into a unit faults.
  CHECK(lorastream::testing::WriteFaults(served.unit_bytes()[0]));
}

TEST_CASE(
    "qwen_image job on an fp8 or nf4 store trains: streamed equals resident bit for bit, the "
    "loss finite and within 5% of the plain base's",
    "[worker][qwen_image][store][quant]") {
  TempDir dir("qwen-image-quant-job");
  const std::string d = dir.str();
  WriteCaches(d);
  const Run plain = Train({JobA(d, d + "/plain")});
  const std::vector<StepStats>& sp = plain.steps.at("a");
  for (QuantMethod method : {QuantMethod::kFp8, QuantMethod::kNf4}) {
    const std::string format = QuantMethodName(method);
    INFO(format);
    const auto published = lorastream::testing::ServeForTest(kModel, method, "qi-" + format);
    const std::string name = published->manifest().store_name;
    const Run resident = Train({OnStore(JobA(d, d + "/resident-" + format), name)});
    const Run streamed = Train({OnStore(
        JobA(d, d + "/streamed-" + format, "[stream]\nblocks_to_swap = 2\nring_size = 1\n"),
        name)});
    const std::vector<StepStats>& sr = resident.steps.at("a");
    CheckSame(streamed.steps.at("a"), sr, d + "/streamed-" + format, d + "/resident-" + format);
    REQUIRE(sr.size() == sp.size());
    for (size_t i = 0; i < sr.size(); ++i) {
      INFO("step " << i + 1 << ": " << sr[i].loss << " against " << sp[i].loss);
      CHECK(std::isfinite(sr[i].loss));
      CHECK(sr[i].loss != sp[i].loss);  // the compressed base is not the plain one
      CHECK(std::fabs(sr[i].loss - sp[i].loss) < 0.05 * std::fabs(sp[i].loss));
    }
  }
}

TEST_CASE(
    "a Qwen-Image job refuses a store of another family or dtype, and other families refuse a "
    "Qwen-Image store, naming the family",
    "[worker][qwen_image][store]") {
  TempDir dir("qwen-image-store-refusals");
  const std::string d = dir.str();
  WriteCaches(d);
  const auto qwen = lorastream::testing::ServeForTest(kModel, QuantMethod::kNone, "qi-refused");
  const std::string qwen_name = qwen->manifest().store_name;
  const auto flux_store = lorastream::testing::ServeForTest(
      lorastream::testing::MakeFluxCheckpoint(d + "/flux"), QuantMethod::kNone, "qi-flux");
  const auto llm = lorastream::testing::ServeForTest(
      lorastream::testing::MakeCheckpoint(d + "/llm", "tiny"), QuantMethod::kNone, "qi-llm");
  using lorastream::testing::ErrorMessageOf;

  // A plain f32 store, a job computing in bf16: both named, and the key that fixes it.
  std::string bf16 = OnStore(JobA(d, d + "/bf16"), qwen_name);
  bf16.replace(bf16.find("[train]\n"), 8, "[train]\ndtype = \"bf16\"\n");
  CHECK_THAT(ErrorMessageOf([&] { Train({bf16}); }),
             Catch::Contains("store `" + qwen_name + "` holds F32 weights") &&
                 Catch::Contains("computes in BF16") &&
                 Catch::Contains("set train.dtype = \"f32\""));
  // A FLUX or an LLM store named by a Qwen-Image job.
  CHECK_THAT(ErrorMessageOf([&] {
               Train({OnStore(JobA(d, d + "/on-flux"), flux_store->manifest().store_name)});
             }),
             Catch::Contains("serves FLUX.1, not Qwen-Image"));
  CHECK_THAT(
      ErrorMessageOf([&] { Train({OnStore(JobA(d, d + "/on-llm"), llm->manifest().store_name)}); }),
      Catch::Contains("serves LLM (llama), not Qwen-Image"));
  // The Qwen-Image store named by an LLM job or a FLUX job.
  CHECK_THAT(
      ErrorMessageOf([&] { BaseWeights::FromStore(qwen_name); }),
      Catch::Contains("serves Qwen-Image, not an LLM") && Catch::Contains("[qwen_image] section"));
  CHECK_THAT(ErrorMessageOf([&] { flux::FluxBase::FromStore(qwen_name, at::kFloat, at::kCPU); }),
             Catch::Contains("serves Qwen-Image, not FLUX.1"));
  // An fp8 file named as the checkpoint: refused naming the tensor and the store's command.
  const std::string fp8 = d + "/qwen_image_fp8_e4m3fn.safetensors";
  lorastream::testing::WriteFp8Checkpoint(kModel, fp8, IsQwenImageBlockLinearWeight);
  CHECK_THAT(ErrorMessageOf([&] { qwen_image::QwenImageBase::Load(fp8, at::kFloat, at::kCPU); }),
             Catch::Contains("is fp8 (F8_E4M3)") &&
                 Catch::Contains("lorastream-store serve " + fp8 + " --name NAME"));
  // A job naming both a store and a checkpoint.
  std::string both = JobA(d, d + "/both");
  both.replace(both.find("[model]\n"), 8, "[model]\nstore = \"" + qwen_name + "\"\n");
  const std::vector<std::string> problems = ValidateJobSpec(ParseJobSpec(both, "both.toml"));
  REQUIRE_FALSE(problems.empty());
  CHECK_THAT(problems.front(), Catch::Contains("both.toml: key `model` must name exactly one of "
                                               "`model.store`"));
}

namespace {

// DIR/cache-e, musubi-tuner's Qwen-Image-Edit caches: "cat" and "dog" (32x32, a 32x32
// control), "pair" (32x32, two controls: Edit-2509's), "wide" (48x32, a 32x48 control).
void WriteEditCaches(const std::string& dir) {
  const int64_t jd = QwenImageCheckpointReader::Open(kModel).config().joint_attention_dim;
  const std::string d = dir + "/cache-e";
  std::filesystem::create_directories(d);
  WriteQwenImageCacheFiles(d, "cat", 32, 32, 5, jd, 11, DType::kBF16, {{32, 32}});
  WriteQwenImageCacheFiles(d, "dog", 32, 32, 3, jd, 12, DType::kBF16, {{32, 32}});
  WriteQwenImageCacheFiles(d, "pair", 32, 32, 4, jd, 13, DType::kBF16, {{32, 32}, {16, 48}});
  WriteQwenImageCacheFiles(d, "wide", 48, 32, 4, jd, 14, DType::kBF16, {{32, 48}});
}

// Job E: job A's settings on the edit caches, `qwen_image.edit = true` (unless `edit` says
// otherwise), 6 steps so that every bucket comes.
std::string JobE(const std::string& dir, const std::string& out, const std::string& stream = "",
                 const std::string& edit = "true") {
  std::string text = JobA(dir, out, stream);
  text.replace(text.find("steps = 4"), 9, "steps = 6");
  text.replace(text.find("name = \"a\""), 10, "name = \"e\"");
  return text.replace(text.find("/cache-a\""), 9, "/cache-e\"\nedit = " + edit);
}

}  // namespace

TEST_CASE(
    "qwen_image edit job: control latents in the sequence; streamed = resident, in a group = "
    "alone, resumed = uninterrupted, bit for bit; the key and the caches must agree",
    "[worker][qwen_image][group]") {
  TempDir dir("qwen-image-edit-job");
  const std::string d = dir.str();
  WriteCaches(d);
  WriteEditCaches(d);
  const JobSpec spec = Spec(JobE(d, d + "/x"));
  CHECK(spec.qwen_image.edit);
  CHECK(Spec(JobSpecToToml(spec)).qwen_image.edit);  // written back (the journal's form)
  const Run alone = Train({JobE(d, d + "/alone-e")});
  const std::vector<StepStats>& se = alone.steps.at("e");
  REQUIRE(se.size() == 6);
  for (const StepStats& s : se) CHECK(std::isfinite(s.loss));
  CHECK(alone.outcomes[0].result.steps_done == 6);

  SECTION("streamed: both blocks through one slot") {
    const Run streamed = Train({JobE(d, d + "/streamed-e", "[stream]\nblocks_to_swap = 2\n")});
    CheckSame(streamed.steps.at("e"), se, d + "/streamed-e", d + "/alone-e");
    CHECK(streamed.steps.at("e")[0].h2d_bytes > 0);
  }
  SECTION("taped: every block") {
    const Run taped = Train({JobE(d, d + "/taped-e", "[stream]\ntaped_blocks = 2\n")});
    CheckSame(taped.steps.at("e"), se, d + "/taped-e", d + "/alone-e");
  }
  SECTION("a group with a plain Qwen-Image job: each equals itself alone") {
    const Run alone_b = Train({JobB(d, d + "/alone-b")});
    const Run group = Train({JobE(d, d + "/group-e"), JobB(d, d + "/group-b")});
    CheckSame(group.steps.at("e"), se, d + "/group-e", d + "/alone-e");
    CheckSame(group.steps.at("b"), alone_b.steps.at("b"), d + "/group-b", d + "/alone-b");
  }
  SECTION("stopped after step 4, then resumed") {
    int steps = 0;
    const Run stopped = Train(
        {JobE(d, d + "/resumed-e")}, [&steps] { return steps >= 4; }, [&steps] { ++steps; });
    CHECK(stopped.outcomes[0].result.steps_done == 4);
    const Run resumed = Train({JobE(d, d + "/resumed-e")});
    CHECK(resumed.outcomes[0].result.start_step == 4);
    REQUIRE(resumed.steps.at("e").size() == 2);
    for (size_t i = 0; i < 2; ++i) CHECK(resumed.steps.at("e")[i].loss == se[4 + i].loss);
    for (const char* file : {qwen_image::kComfyAdapterFile, qwen_image::kQwenDiffusersAdapterFile})
      CHECK(ReadFile(d + "/resumed-e/" + file) == ReadFile(d + "/alone-e/" + file));
  }
  SECTION("other control latents: other losses") {
    // cat's and dog's files rewritten with their control latents negated (bf16: the sign bit
    // of each element's high byte), the images and captions as they were.
    for (const std::string name : {"cat", "dog"}) {
      const std::string path = d + "/cache-e/" + name + "_0032x0032_qie.safetensors";
      const SafetensorsFile f = SafetensorsFile::Open(path);
      std::vector<std::vector<uint8_t>> bytes;
      std::vector<TensorToWrite> w;
      for (const auto& e : f.tensors()) {
        const uint8_t* p = f.Data(e);
        bytes.emplace_back(p, p + e.nbytes());
        REQUIRE(e.dtype == DType::kBF16);
        if (e.name.find("control") != std::string::npos)
          for (size_t i = 1; i < bytes.back().size(); i += 2) bytes.back()[i] ^= 0x80;
      }
      for (size_t i = 0; i < f.tensors().size(); ++i)
        w.push_back(
            {f.tensors()[i].name, f.tensors()[i].dtype, f.tensors()[i].shape, bytes[i].data()});
      const auto metadata = f.header().metadata;
      WriteSafetensors(path + ".new", w, metadata);
      std::filesystem::rename(path + ".new", path);
    }
    const Run changed = Train({JobE(d, d + "/changed-e")});
    int same_bucket_steps = 0, differ = 0;
    for (size_t i = 0; i < se.size(); ++i) {
      if (se[i].tokens != 2 * 4) continue;  // the cat and dog batch: 2 x (2 x 2) image tokens
      ++same_bucket_steps;
      if (changed.steps.at("e")[i].loss != se[i].loss) ++differ;
    }
    CHECK(same_bucket_steps > 0);
    CHECK(differ == same_bucket_steps);
  }
  SECTION("the key and the caches disagree: refused naming both") {
    using lorastream::testing::ErrorMessageOf;
    CHECK_THAT(ErrorMessageOf([&] { Train({JobE(d, d + "/plain-e", "", "false")}); }),
               Catch::Contains(d + "/cache-e: the folder holds Qwen-Image-Edit caches (" + d +
                               "/cache-e/") &&
                   Catch::Contains("set `qwen_image.edit = true`"));
    std::string on_plain = JobA(d, d + "/edit-a");
    on_plain.replace(on_plain.find("/cache-a\""), 9, "/cache-a\"\nedit = true");
    CHECK_THAT(ErrorMessageOf([&] { Train({on_plain}); }),
               Catch::Contains(d + "/cache-a: `qwen_image.edit = true` but the folder holds "
                                   "Qwen-Image caches without control images"));
  }
}
