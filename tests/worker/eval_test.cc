// Evaluation: forward-only without an autograd graph, a token-weighted mean, run at the steps
// the job asks for, bit-equal between a streamed and a resident run, and invisible to
// training (the training losses and adapter do not change when evaluations are added).
#include "torch_catch.h"  // first: see there

#include <cmath>
#include <cstring>
#include <fstream>

#include <c10/core/GradMode.h>
#include <nlohmann/json.hpp>

#include "common/job/job_data.h"
#include "worker/model/base_weights.h"
#include "worker/stream/resident_provider.h"
#include "worker/train/evaluate.h"
#include "worker/train/stream_provider.h"
#include "worker/train/trainer.h"
#include "worker_test_util.h"

using namespace lorastream;
using namespace lorastream::worker;

namespace {

struct Run {
  std::vector<double> losses;
  std::vector<StepStats> stats;
  std::string adapter;
};

Run Train(JobSpec spec, bool streamed, int swap = 0, int ring = 2) {
  spec.stream.blocks_to_swap = swap;
  spec.stream.ring_size = ring;
  TrainOptions o;
  o.threads = 1;  // 2 cores shared with the rest of CI
  o.resume = false;
  if (streamed) {
    o.make_provider = [](const JobSpec& j, const BaseWeights& b, const std::string& d,
                         const std::string& t, const std::vector<JobSpec>&) {
      StreamEngineOptions opt;
      opt.log_plan = false;
      return MakeStreamProvider(j, b, d, t, opt);
    };
  }
  Run r;
  RunTraining(spec, o, [&](const StepStats& s) {
    r.losses.push_back(s.loss);
    r.stats.push_back(s);
  });
  r.adapter = testing::ReadFile(spec.train.output_dir + "/adapter_model.safetensors");
  return r;
}

bool BitEqual(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

}  // namespace

TEST_CASE(
    "evaluation builds no autograd graph and does no gradient work; the same forward "
    "with grad would",
    "[worker]") {
  testing::TempDir dir("evalgraph");
  BaseWeights base = BaseWeights::FromCheckpoint(testing::MakeCheckpoint(dir / "m", "tiny"));
  ResidentProvider provider(base, at::kCPU, at::kFloat);
  CausalLm model(base.config(), base.rest(), &provider, at::kCPU, at::kFloat);
  LoraSettings settings = LoraSettingsFromSpec(LoraSpec{});
  LoraAdapter adapter = LoraAdapter::Init(base.config(), settings, 3, at::kCPU);
  REQUIRE(adapter.Params().front().requires_grad());
  SequenceSet set;
  set.seq_len = 16;
  set.count = 2;
  for (int i = 0; i < 32; ++i) {
    set.ids.push_back(i * 7 % 500);
    set.labels.push_back(i * 7 % 500);
  }
  const Batch batch = MakeBatchOf(set, {0, 1});
  model.set_head_chunk_rows(5);  // the chunked head in chunks that do not divide 32 rows
  at::Tensor loss = EvalLossSum(model, adapter, batch);
  CHECK_FALSE(loss.requires_grad());
  CHECK(loss.grad_fn() == nullptr);
  CHECK(c10::GradMode::is_enabled());  // the guard ended with the call
  // The same computation outside the guard builds a graph back to the adapter: what the
  // checks above would see if the evaluation forgot to turn autograd off.
  provider.BeginStep();
  at::Tensor ids = ToDeviceLong(batch.ids, batch.rows, batch.seq_len, at::kCPU);
  at::Tensor targets = ToDeviceLong(batch.targets, batch.rows, batch.seq_len, at::kCPU);
  at::Tensor with_grad = model.HeadLossSum(model.Hidden(ids, adapter, false, false, 0), targets);
  CHECK(with_grad.grad_fn() != nullptr);
  CHECK(BitEqual(with_grad.item<double>(), loss.item<double>()));

  // Token-weighted: one batch of everything equals batches of one sequence each.
  set.labels[3] = kIgnoreIndex;  // the two sequences now have different target counts
  for (int i = 16; i < 31; ++i) set.labels[i] = kIgnoreIndex;
  const EvalResult whole = Evaluate(model, adapter, set, 2, 0);
  const EvalResult single = Evaluate(model, adapter, set, 1, 0);
  CHECK(whole.tokens == 14 + 1);  // 14 targets in the first row, 1 in the second
  CHECK(single.tokens == whole.tokens);
  CHECK(single.loss == Approx(whole.loss).epsilon(1e-6));
  const EvalResult first = Evaluate(model, adapter, set, 1, 1);  // eval.batches = 1
  CHECK(first.tokens == 14);
  CHECK(first.loss != Approx(whole.loss).epsilon(1e-6));
}

TEST_CASE(
    "eval runs every N steps, at checkpoints and at the end; streamed equals resident "
    "bit for bit; training is unchanged by it",
    "[worker]") {
  testing::TempDir dir("evaltrain");
  testing::MakeCheckpoint(dir / "m", "tiny");
  testing::WriteJsonl(dir / "d.jsonl", 12, 20, 60, 512);
  JobSpec spec = testing::TinyJob(dir / "m", dir / "d.jsonl", dir / "plain");
  spec.data.seq_len = 16;
  spec.train.steps = 5;
  spec.train.checkpoint_every = 3;
  ResolveJobSpec(spec);
  const Run plain = Train(spec, false);
  for (const StepStats& s : plain.stats) CHECK_FALSE(s.has_eval());

  JobSpec with_eval = spec;
  with_eval.eval.path = dir / "d.jsonl";  // the training file itself: the split is tested apart
  with_eval.eval.format = "jsonl";
  with_eval.eval.every = 2;
  with_eval.eval.batches = 2;
  with_eval.train.output_dir = dir / "eval";
  const Run resident = Train(with_eval, false);
  REQUIRE(resident.stats.size() == 5);
  std::vector<int64_t> eval_steps;
  for (const StepStats& s : resident.stats)
    if (s.has_eval()) eval_steps.push_back(s.step);
  CHECK(eval_steps == std::vector<int64_t>{2, 3, 4, 5});  // every 2, checkpoint 3, the end
  CHECK(resident.stats[1].eval_tokens == 2 * 2 * 15);     // batches x rows x (seq_len - 1)
  CHECK(resident.stats[3].eval_loss < resident.stats[1].eval_loss);  // it learns the file
  // Evaluations do not disturb training: same losses, same adapter as without them.
  for (size_t i = 0; i < plain.losses.size(); ++i)
    CHECK(BitEqual(resident.losses[i], plain.losses[i]));
  CHECK(resident.adapter == plain.adapter);
  // stats.jsonl carries eval_loss on those steps only.
  std::ifstream lines(dir / "eval/stats.jsonl");
  std::string line;
  int with_field = 0;
  while (std::getline(lines, line)) with_field += nlohmann::json::parse(line).contains("eval_loss");
  CHECK(with_field == 4);

  for (int ring : {1, 2}) {
    for (int swap : {2, 4}) {
      CAPTURE(ring, swap);
      with_eval.train.output_dir = dir / ("s" + std::to_string(ring) + std::to_string(swap));
      const Run streamed = Train(with_eval, true, swap, ring);
      REQUIRE(streamed.stats.size() == 5);
      for (size_t i = 0; i < 5; ++i) {
        CHECK(streamed.stats[i].has_eval() == resident.stats[i].has_eval());
        CHECK(BitEqual(streamed.stats[i].eval_loss, resident.stats[i].eval_loss));
        CHECK(BitEqual(streamed.losses[i], resident.losses[i]));
      }
      CHECK(streamed.adapter == resident.adapter);
    }
  }
}

TEST_CASE(
    "train.epochs sets the steps from the data; eval.split trains without the held-out "
    "documents",
    "[worker]") {
  testing::TempDir dir("epochs");
  testing::MakeCheckpoint(dir / "m", "tiny");
  testing::WriteJsonl(dir / "d.jsonl", 10, 16, 16, 512);  // 160 tokens
  JobSpec spec = testing::TinyJob(dir / "m", dir / "d.jsonl", dir / "a");
  spec.data.seq_len = 8;
  spec.train.steps = 0;
  spec.train.epochs = 0.5;
  spec.eval.split = 0.2;  // 8 training documents = 16 sequences of 8
  ResolveJobSpec(spec);
  const Run r = Train(spec, false);
  CHECK(r.stats.size() == 4);  // ceil(0.5 * 16 / 2)
  CHECK(r.stats.back().total_steps == 4);
  CHECK(r.stats.back().has_eval());            // at the end
  CHECK(r.stats.back().eval_tokens == 4 * 7);  // 2 held-out documents = 4 sequences
}
