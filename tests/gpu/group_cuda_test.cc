// Job groups on CUDA (worker/train/group_trainer.h): two jobs of different lengths, ranks and
// targets trained in one group, streamed and resident, give each job's losses and adapter
// alone within bf16 rounding (the group's base GEMMs over the concatenated rows may pick other
// kernels than one job's), a resident group runs from CUDA graphs, and a streamed group copies
// per micro-batch what one job copies.
#include <cmath>
#include <map>
#include <vector>

#include <ATen/ATen.h>

#include <catch2/catch.hpp>

#include "common/formats/safetensors.h"
#include "tests/gpu/cuda_train_options.h"
#include "tests/worker/worker_test_util.h"
#include "worker/train/group_trainer.h"
#include "worker/train/stream_provider.h"

using namespace lorastream;
using namespace lorastream::worker;
using namespace lorastream::testing;

namespace {

JobSpec Job(const std::string& model, const std::string& data, const std::string& out,
            const std::string& name, bool streamed) {
  JobSpec s = TinyJob(model, data, out);
  s.name = name;
  s.train.dtype = "bf16";
  s.train.steps = 3;
  s.stream.blocks_to_swap = streamed ? 2 : 0;
  s.stream.ring_size = 1;
  if (name == "c") {  // a's shape: a group of a and c batches its LoRA GEMMs over the jobs
    s.train.seed = 33;
    s.optim.lr *= 2;
  }
  if (name == "b") {
    s.data.seq_len = 48;
    s.lora.rank = 8;
    s.lora.targets = {"q_proj", "v_proj", "down_proj"};
    s.train.seed = 21;
    s.train.grad_accum = 2;
  }
  return s;
}

struct Run {
  std::map<std::string, std::vector<StepStats>> steps;
  std::map<std::string, int64_t> graphed;  // micro-batches replayed from a CUDA graph
};

Run Train(const std::string& model, const std::string& data, const std::string& dir,
          const std::vector<std::string>& names, bool streamed) {
  Run r;
  std::vector<GroupJob> jobs;
  for (const std::string& n : names) {
    GroupJob j;
    j.spec = Job(model, data, dir + "/" + n, n, streamed);
    j.on_step = [&r, n](const StepStats& s) { r.steps[n].push_back(s); };
    jobs.push_back(std::move(j));
  }
  for (const GroupJobOutcome& out : RunGroupTraining(std::move(jobs), CudaTrainOptions(streamed))) {
    INFO(out.name);
    REQUIRE(!out.error);
    r.graphed[out.name] = out.result.graphed_micro_batches;
  }
  return r;
}

// Largest |a - b| / max|b| over the adapters' tensors (f32, as peft saves them).
double AdapterDistance(const std::string& a, const std::string& b) {
  const SafetensorsFile fa = SafetensorsFile::Open(a + "/adapter_model.safetensors");
  const SafetensorsFile fb = SafetensorsFile::Open(b + "/adapter_model.safetensors");
  auto tensor = [](const SafetensorsFile& f, const SafetensorsEntry& e) {
    return at::from_blob(const_cast<uint8_t*>(f.Data(e)), e.shape, at::kFloat).to(at::kDouble);
  };
  double worst = 0;
  for (const SafetensorsEntry& e : fb.tensors()) {
    const SafetensorsEntry* other = fa.Find(e.name);
    REQUIRE(other != nullptr);
    const at::Tensor ta = tensor(fa, *other), tb = tensor(fb, e);
    const double scale = std::max(tb.abs().max().item<double>(), 1e-12);
    worst = std::max(worst, (ta - tb).abs().max().item<double>() / scale);
  }
  return worst;
}

// Job a and `partner` trained alone (into DIR/alone-NAMETAG) and as one group (into
// DIR/groupTAG), each job of the group checked against its run alone: losses and adapter
// within bf16 rounding.
struct Trained {
  Run a, partner, group;
};
Trained TrainAloneAndGrouped(const std::string& model, const std::string& data,
                             const std::string& dir, const std::string& partner, bool streamed) {
  const std::string tag = streamed ? "/streamed" : "/resident";
  Trained t;
  t.a = Train(model, data, dir + "/alone-a" + tag, {"a"}, streamed);
  t.partner = Train(model, data, dir + "/alone-" + partner + tag, {partner}, streamed);
  t.group = Train(model, data, dir + "/group" + tag, {"a", partner}, streamed);
  const std::pair<std::string, const Run*> jobs[] = {{"a", &t.a}, {partner, &t.partner}};
  for (const auto& [name, alone] : jobs) {
    CAPTURE(name);
    const std::vector<StepStats>& want = alone->steps.at(name);
    const std::vector<StepStats>& got = t.group.steps.at(name);
    REQUIRE(got.size() == want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      CHECK(std::isfinite(got[i].loss));
      CHECK(got[i].loss == Approx(want[i].loss).epsilon(2e-2));
    }
    CHECK(AdapterDistance(dir + "/group" + tag + "/" + name,
                          dir + "/alone-" + name + tag + "/" + name) < 5e-2);
  }
  return t;
}

}  // namespace

TEST_CASE("CUDA: a job in a group trains as it does alone within bf16 rounding", "[gpu]") {
  TempDir dir("cuda-group");
  const std::string model = MakeCheckpoint(dir / "model", "tiny");
  const std::string data = WriteJsonl(dir / "d.jsonl", 16, 40, 80, 512);
  for (bool streamed : {false, true}) {
    CAPTURE(streamed);
    const Trained t = TrainAloneAndGrouped(model, data, dir.str(), "b", streamed);
    if (!streamed) {
      // Resident, the group's micro-batches replay CUDA graphs from the second on: one per
      // composition ({a, b}, then b alone in its second micro-batch).
      CHECK(t.group.graphed.at("a") == 2);
      CHECK(t.group.graphed.at("b") == 4);
    }
    if (streamed) {
      // b's step has two micro-batches, a's one: the group's step makes two passes, as b's.
      CHECK(t.group.steps.at("a")[1].h2d_bytes == t.partner.steps.at("b")[1].h2d_bytes);
    }
  }
}

TEST_CASE("CUDA: jobs of one shape (LoRA GEMMs batched over the jobs) train as each alone",
          "[gpu]") {
  TempDir dir("cuda-group-batched");
  const std::string model = MakeCheckpoint(dir / "model", "tiny");
  const std::string data = WriteJsonl(dir / "d.jsonl", 16, 40, 80, 512);
  for (bool streamed : {false, true}) {
    CAPTURE(streamed);
    TrainAloneAndGrouped(model, data, dir.str(), "c", streamed);
  }
}
