// Which jobs may share a job group (the rule the worker's group and the coordinator's slots
// both apply) and a worker's default number of job slots.
#include <catch2/catch.hpp>

#include <functional>
#include <utility>

#include "common/job/job_group.h"

using namespace lorastream;

namespace {

JobSpec Spec(const std::string& name) {
  JobSpec s;
  s.name = name;
  s.model.store = "base";
  return s;
}

}  // namespace

TEST_CASE("job groups: a job that differs in base, dtype or plan is refused naming the field",
          "[common]") {
  const JobSpec a = Spec("a");
  auto refusal = [&](const std::function<void(JobSpec&)>& change,
                     const std::string& device = "cpu") {
    JobSpec b = Spec("b");
    change(b);
    return GroupRefusal(a, b, device);
  };
  CHECK(refusal([](JobSpec&) {}).empty());
  // Everything of a job's own may differ.
  CHECK(refusal([](JobSpec& b) {
          b.lora.rank = 64;
          b.train.seed = 9;
          b.data.seq_len = 2048;
          b.train.grad_accum = 4;
        }).empty());
  CHECK_THAT(refusal([](JobSpec& b) { b.model.store = "other"; }),
             Catch::Contains("job b cannot train in a group with job a") &&
                 Catch::Contains("model.store"));
  CHECK_THAT(refusal([](JobSpec& b) { b.train.dtype = "bf16"; }), Catch::Contains("train.dtype"));
  // "auto" is what the device makes of it: bf16 on CUDA, f32 on the CPU.
  CHECK(refusal([](JobSpec& b) { b.train.dtype = "bf16"; }, "cuda:0").empty());
  CHECK(refusal([](JobSpec& b) { b.train.dtype = "f32"; }, "cpu").empty());
  CHECK_THAT(refusal([](JobSpec& b) { b.stream.ring_size = 3; }),
             Catch::Contains("stream.ring_size"));
  CHECK_THAT(refusal([](JobSpec& b) { b.stream.budget_auto = !b.stream.budget_auto; }),
             Catch::Contains("stream.gpu_memory_budget"));
}

TEST_CASE(
    "job groups: FLUX.1 jobs group with FLUX.1 jobs of one base, dtype and plan; never with an "
    "LLM job",
    "[common]") {
  JobSpec flux = Spec("flux");
  flux.is_flux = true;
  flux.flux.store = "flux-base";
  const JobSpec llm = Spec("llm");
  for (const auto& [first, job] : {std::pair{llm, flux}, std::pair{flux, llm}}) {
    const std::string why = GroupRefusal(first, job, "cuda:0");
    CHECK_THAT(why, Catch::Contains("cannot train in a group with job " + first.name) &&
                        Catch::Contains("FLUX.1 jobs share a group only with FLUX.1 jobs"));
  }
  auto refusal = [&](const std::function<void(FluxJob&)>& change) {
    JobSpec other = flux;
    other.name = "flux2";
    change(other.flux);
    return GroupRefusal(flux, other, "cuda:0");
  };
  // Everything of a job's own may differ.
  CHECK(refusal([](FluxJob& j) {
          j.cache_dir = "other";
          j.output_dir = "out2";
          j.rank = 64;
          j.targets = {"attention"};
          j.batch_size = 4;
          j.steps = 7;
          j.seed = 9;
          j.timestep_sampling = "shift";
        }).empty());
  CHECK_THAT(refusal([](FluxJob& j) { j.store = "other"; }),
             Catch::Contains("job flux2 cannot train in a group with job flux") &&
                 Catch::Contains("flux.store differs"));
  CHECK_THAT(refusal([](FluxJob& j) { j.checkpoint = "flux1.safetensors"; }),
             Catch::Contains("flux.checkpoint differs"));
  CHECK_THAT(refusal([](FluxJob& j) { j.dtype = "bf16"; }), Catch::Contains("flux.dtype differs"));
  CHECK_THAT(refusal([](FluxJob& j) { j.singles_per_unit = 1; }),
             Catch::Contains("flux.singles_per_unit differs"));
  CHECK_THAT(refusal([](FluxJob& j) { j.budget_auto = true; }),
             Catch::Contains("flux.gpu_memory_budget differs"));
  CHECK_THAT(refusal([](FluxJob& j) { j.blocks_to_swap = 3; }),
             Catch::Contains("flux.blocks_to_swap differs"));
  CHECK_THAT(refusal([](FluxJob& j) { j.ring_size = 1; }),
             Catch::Contains("flux.ring_size differs"));
}

TEST_CASE("job groups: a FLUX.1 job in the shared form is refused naming its keys there",
          "[common][flux]") {
  JobSpec flux = Spec("flux");
  flux.is_flux = true;
  flux.flux.store = "flux-base";
  auto refusal = [&](const std::function<void(FluxJob&)>& change) {
    JobSpec other = flux;
    other.name = "flux2";
    other.flux.shared_form = true;  // written with [model], [train], [stream]
    change(other.flux);
    return GroupRefusal(flux, other, "cuda:0");
  };
  CHECK_THAT(refusal([](FluxJob& j) { j.store = "other"; }),
             Catch::Contains("model.store differs") && !Catch::Contains("flux.store"));
  CHECK_THAT(refusal([](FluxJob& j) { j.checkpoint = "flux1.safetensors"; }),
             Catch::Contains("model.checkpoint differs"));
  CHECK_THAT(refusal([](FluxJob& j) { j.dtype = "bf16"; }), Catch::Contains("train.dtype differs"));
  CHECK_THAT(refusal([](FluxJob& j) { j.budget_auto = true; }),
             Catch::Contains("stream.gpu_memory_budget differs"));
  CHECK_THAT(refusal([](FluxJob& j) { j.ring_size = 1; }),
             Catch::Contains("stream.ring_size differs"));
  // FLUX.1's own key stays in [flux].
  CHECK_THAT(refusal([](FluxJob& j) { j.singles_per_unit = 1; }),
             Catch::Contains("flux.singles_per_unit differs"));
}

TEST_CASE("job groups: a worker's default job slots follow its GPU's memory", "[common]") {
  CHECK(DefaultJobSlots(0) == 1);             // the CPU
  CHECK(DefaultJobSlots(8ull << 30) == 1);    // a small GPU still trains one job
  CHECK(DefaultJobSlots(24ull << 30) == 1);   // RTX 4090
  CHECK(DefaultJobSlots(40ull << 30) == 2);   // A100 40 GB
  CHECK(DefaultJobSlots(80ull << 30) == 4);   // H100 80 GB
  CHECK(DefaultJobSlots(141ull << 30) == 4);  // H200: at most 4
}
