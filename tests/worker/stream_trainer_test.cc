// The proof through the real trainer: on the tiny model, for ring sizes 1, 2, 3 and
// every swap count from 0 to all blocks, a streamed training run (RunTraining with the
// streaming engine as its provider) gives bit-identical losses, gradient norms and final
// adapter to the fully resident run; also with a slowed copy thread that poisons each slot
// before copying into it (so compute that did not wait would read NaN).
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <random>

#include <catch2/catch.hpp>

#include "common/formats/data.h"
#include "common/job/job_spec.h"
#include "store/synth.h"
#include "tests/support/test_support.h"
#include "worker/model/base_weights.h"
#include "worker/train/stream_provider.h"
#include "worker/train/trainer.h"

using namespace lorastream;
using namespace lorastream::worker;
using namespace lorastream::store;

namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  REQUIRE(in.good());
  return std::string(std::istreambuf_iterator<char>(in), {});
}

struct RunRecord {
  std::vector<double> losses, grad_norms;
  std::vector<StepStats> stats;
  std::string adapter;  // adapter_model.safetensors bytes
};

class TinyJob {
 public:
  TinyJob() {
    SynthOptions s;
    s.preset = "tiny";
    s.presets_dir = std::string(LORASTREAM_SOURCE_DIR) + "/configs/models";
    s.out_dir = dir_.str() + "/model";
    s.seed = 3;
    s.threads = 1;
    RunSynth(s);
    std::mt19937 rng(5);
    std::vector<Document> docs(6);
    for (auto& d : docs) {
      for (int i = 0; i < 40; ++i) d.ids.push_back(static_cast<int32_t>(rng() % 512));
    }
    WriteTokenFile(dir_.str() + "/data.tok", docs, 2, false);
  }

  RunRecord Run(int swap, int ring, bool streamed, const StreamEngineOptions& options = {},
                const std::function<void(JobSpec&)>& tweak = {}) {
    JobSpec spec;
    spec.name = "stream-parity";
    spec.model.checkpoint = dir_.str() + "/model";
    spec.data.path = dir_.str() + "/data.tok";
    spec.data.seq_len = 16;
    spec.lora.rank = 4;
    spec.optim.lr = 1e-2;
    spec.train.steps = 2;
    spec.train.batch_size = 2;
    spec.train.grad_accum = 2;  // two passes per step
    spec.train.seed = 9;
    spec.train.output_dir = dir_.str() + "/out-" + std::to_string(runs_++);
    spec.stream.blocks_to_swap = swap;
    spec.stream.ring_size = ring;
    if (tweak) tweak(spec);
    ResolveJobSpec(spec);
    TrainOptions o;
    o.device = "cpu";
    o.resume = false;
    o.threads = 2;
    if (streamed) {
      o.make_provider = [options](const JobSpec& j, const BaseWeights& b, const std::string& d,
                                  const std::string& t, const std::vector<JobSpec>&) {
        StreamEngineOptions opt = options;
        opt.log_plan = false;
        return MakeStreamProvider(j, b, d, t, opt);
      };
    }
    RunRecord r;
    RunTraining(spec, o, [&](const StepStats& s) {
      r.losses.push_back(s.loss);
      r.grad_norms.push_back(s.grad_norm);
      r.stats.push_back(s);
    });
    r.adapter = ReadFile(spec.train.output_dir + "/adapter_model.safetensors");
    return r;
  }

  std::string dir() const { return dir_.str(); }

 private:
  testing::TempDir dir_{"stream"};
  int runs_ = 0;
};

bool BitEqual(const std::vector<double>& a, const std::vector<double>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0;
}

}  // namespace

TEST_CASE("trainer: streamed runs equal the resident run bit for bit", "[worker]") {
  TinyJob job;
  const RunRecord want = job.Run(0, 2, /*streamed=*/false);
  REQUIRE(want.losses.size() == 2);
  REQUIRE(std::isfinite(want.losses[1]));
  for (int ring = 1; ring <= 3; ++ring) {
    for (int swap = 0; swap <= 4; ++swap) {
      CAPTURE(ring, swap);
      const RunRecord got = job.Run(swap, ring, /*streamed=*/true);
      REQUIRE(BitEqual(got.losses, want.losses));
      REQUIRE(BitEqual(got.grad_norms, want.grad_norms));
      REQUIRE(got.adapter == want.adapter);
      if (swap > ring) {
        // Steady step: 2 passes x (2 x swap - 2 x ring) copies; the cold first step copies
        // the first ring's worth more.
        REQUIRE(got.stats[1].copies == 2 * (2 * swap - 2 * ring));
        REQUIRE(got.stats[0].copies == got.stats[1].copies + ring);
      }
    }
  }
}

TEST_CASE("trainer: a slowed, poisoning copy thread still gives the resident results", "[worker]") {
  TinyJob job;
  const RunRecord want = job.Run(0, 2, /*streamed=*/false);
  StreamEngineOptions slow;
  slow.debug_poison = true;
  slow.debug_copy_delay_us = 2000;
  for (int ring : {1, 2}) {
    CAPTURE(ring);
    const RunRecord got = job.Run(4, ring, /*streamed=*/true, slow);
    REQUIRE(BitEqual(got.losses, want.losses));
    REQUIRE(got.adapter == want.adapter);
    REQUIRE(got.stats[1].h2d_busy_seconds >= got.stats[1].copies * 0.002);
  }
}

TEST_CASE("trainer: phase slots and the cost model's budget plan give the resident results",
          "[worker]") {
  TinyJob job;
  const RunRecord want = job.Run(0, 2, /*streamed=*/false);
  for (auto [f, b] : {std::pair<int64_t, int64_t>{3, 2}, {2, 4}, {-1, -1}}) {
    CAPTURE(f, b);
    const RunRecord got = job.Run(4, 1, /*streamed=*/true, {}, [&](JobSpec& s) {
      s.stream.forward_slots = f;
      s.stream.backward_slots = b;
    });
    REQUIRE(BitEqual(got.losses, want.losses));
    REQUIRE(BitEqual(got.grad_norms, want.grad_norms));
    REQUIRE(got.adapter == want.adapter);
  }
  // Taped blocks, streamed or resident: the last blocks skip their recompute, nothing else
  // changes.
  for (auto [swap, taped] : {std::pair<int, int64_t>{4, 2}, {2, -1}, {0, 4}}) {
    CAPTURE(swap, taped);
    const RunRecord t =
        job.Run(swap, 1, /*streamed=*/true, {}, [&](JobSpec& s) { s.stream.taped_blocks = taped; });
    REQUIRE(BitEqual(t.losses, want.losses));
    REQUIRE(BitEqual(t.grad_norms, want.grad_norms));
    REQUIRE(t.adapter == want.adapter);
  }
  // A budget that only the all-streamed plans fit: the cost model chooses (calibrating on
  // this CPU, cached in the test's folder), and the run still equals the resident one.
  REQUIRE(setenv("LORASTREAM_CACHE_DIR", (job.dir() + "/cache").c_str(), 1) == 0);
  uint64_t budget = 0;
  const RunRecord got = job.Run(0, 2, /*streamed=*/true, {}, [&](JobSpec& s) {
    const BaseWeights base = BaseWeights::ForJob(s);
    const MemoryModelInputs in =
        JobMemoryInputs(s, ComputeLayout(base, at::kFloat), c10::Device(c10::kCPU), at::kFloat);
    budget = EstimateMemory(in, PlanFromSwapCount(4, 4, 1)).total();
    REQUIRE(EstimateMemory(in, PlanFromSwapCount(4, 3, 1)).total() > budget);
    s.stream.gpu_memory_budget = budget;
  });
  unsetenv("LORASTREAM_CACHE_DIR");
  REQUIRE(BitEqual(got.losses, want.losses));
  REQUIRE(got.adapter == want.adapter);
  REQUIRE(got.stats[1].copies > 0);  // everything streamed
}

TEST_CASE("trainer: gpu_memory_budget \"auto\" on the CPU is no budget: the job's own plan",
          "[worker]") {
  StreamSpec st;
  st.budget_auto = true;
  CHECK(JobMemoryBudget(st, c10::Device(c10::kCPU)) == 0);
  st.budget_auto = false;
  st.gpu_memory_budget = 12345;
  CHECK(JobMemoryBudget(st, c10::Device(c10::kCPU)) == 12345);
  TinyJob job;
  const RunRecord want = job.Run(0, 2, /*streamed=*/false);
  // No calibration (it would write into this folder's cache), the swap plan as given.
  REQUIRE(setenv("LORASTREAM_CACHE_DIR", (job.dir() + "/cache").c_str(), 1) == 0);
  const RunRecord got =
      job.Run(4, 1, /*streamed=*/true, {}, [](JobSpec& s) { s.stream.budget_auto = true; });
  unsetenv("LORASTREAM_CACHE_DIR");
  CHECK_FALSE(std::filesystem::exists(job.dir() + "/cache"));
  REQUIRE(got.stats[1].copies > 0);  // 4 streamed through one slot
  REQUIRE(BitEqual(got.losses, want.losses));
  REQUIRE(got.adapter == want.adapter);
}

TEST_CASE(
    "trainer: the LM head streamed and the embedding table in host RAM give the "
    "resident results bit for bit",
    "[worker]") {
  TinyJob job;
  const RunRecord want = job.Run(0, 2, /*streamed=*/false);
  REQUIRE(setenv("LORASTREAM_CACHE_DIR", (job.dir() + "/cache").c_str(), 1) == 0);
  // A budget that only plans with the head streamed fit: every block streamed through one
  // slot, the head on the device at the LM head only.
  uint64_t head_bytes = 0, block_bytes = 0;
  bool head_streamed = false;
  const auto at_minimum = [&](JobSpec& s) {
    const BaseWeights base = BaseWeights::ForJob(s);
    const MemoryModelInputs in =
        JobMemoryInputs(s, ComputeLayout(base, at::kFloat), c10::Device(c10::kCPU), at::kFloat);
    ResidencyPlan plan = PlanFromSwapCount(4, 4, 1);
    const uint64_t resident_head = EstimateMemory(in, plan).total();
    plan.head_streamed = true;
    s.stream.gpu_memory_budget = EstimateMemory(in, plan).total();
    REQUIRE(resident_head > s.stream.gpu_memory_budget);
    head_bytes = in.head_bytes;
    block_bytes = in.block_bytes[0];
    head_streamed =
        PlanJobStream(s, base, in, c10::Device(c10::kCPU), at::kFloat).plan.head_streamed;
  };
  StreamEngineOptions slow;
  slow.debug_poison = true;
  slow.debug_copy_delay_us = 1000;
  const RunRecord got = job.Run(0, 1, /*streamed=*/true, slow, at_minimum);
  unsetenv("LORASTREAM_CACHE_DIR");
  REQUIRE(head_streamed);
  REQUIRE(BitEqual(got.losses, want.losses));
  REQUIRE(BitEqual(got.grad_norms, want.grad_norms));
  REQUIRE(got.adapter == want.adapter);
  // Each of the step's two passes copied the head once, besides its blocks.
  const StepStats& s = got.stats[1];
  REQUIRE(s.copies > 2);
  REQUIRE(s.h2d_bytes == static_cast<uint64_t>(s.copies - 2) * block_bytes + 2 * head_bytes);
}
