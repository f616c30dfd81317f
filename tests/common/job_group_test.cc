// Which jobs may share a job group (the rule the worker's group and the coordinator's slots
// both apply) and a worker's default number of job slots.
#include <catch2/catch.hpp>

#include <functional>
#include <utility>

#include "common/job_group.h"

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

TEST_CASE("job groups: a FLUX.1 job trains alone, never with an LLM job or another FLUX job",
          "[common]") {
  JobSpec flux = Spec("flux");
  flux.is_flux = true;
  JobSpec other_flux = flux;
  other_flux.name = "flux2";
  const JobSpec llm = Spec("llm");
  for (const auto& [first, job] :
       {std::pair{llm, flux}, std::pair{flux, llm}, std::pair{flux, other_flux}}) {
    const std::string why = GroupRefusal(first, job, "cuda:0");
    CHECK_THAT(why,
               Catch::Contains("cannot train in a group with job " + first.name) &&
                   Catch::Contains("is a FLUX.1 job, which trains alone in its worker's group"));
  }
}

TEST_CASE("job groups: a worker's default job slots follow its GPU's memory", "[common]") {
  CHECK(DefaultJobSlots(0) == 1);             // the CPU
  CHECK(DefaultJobSlots(8ull << 30) == 1);    // a small GPU still trains one job
  CHECK(DefaultJobSlots(24ull << 30) == 1);   // RTX 4090
  CHECK(DefaultJobSlots(40ull << 30) == 2);   // A100 40 GB
  CHECK(DefaultJobSlots(80ull << 30) == 4);   // H100 80 GB
  CHECK(DefaultJobSlots(141ull << 30) == 4);  // H200: at most 4
}
