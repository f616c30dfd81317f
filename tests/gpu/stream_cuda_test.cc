// The streaming engine's CUDA backend: streamed runs equal the resident run bit for bit on
// the GPU (ring 1..3, several swap counts), with poisoned slots and copies delayed on the copy
// stream (so compute that did not wait for a copy would read NaN), through registered
// read-only host memory and through the pinned staging fallback; statistics come from events;
// GPU results match the CPU backend's within f32 rounding.
#include <cmath>
#include <tuple>

#include <ATen/ATen.h>
#include <catch2/catch.hpp>

#include "tests/worker/stream_chain.h"
#include "tests/worker/stream_test_blocks.h"
#include "worker/stream/stream_engine.h"

using namespace lorastream;
using namespace lorastream::worker;
using namespace lorastream::testing;

namespace {

const c10::Device kCuda(c10::kCUDA, 0);

std::unique_ptr<StreamEngine> Engine(const HostBlocks& host, int swap, int ring, c10::Device device,
                                     StreamEngineOptions o = {}) {
  o.log_plan = false;
  return MakeStreamEngine(host.manifest(), host.pointers(),
                          PlanFromSwapCount(host.manifest().config.num_hidden_layers, swap, ring),
                          device, o);
}

ChainResult Step(StreamEngine& engine, const ChainAdapter& ad, const at::Tensor& x,
                 StepStats* stats = nullptr) {
  engine.BeginStep();
  ChainResult r = RunCheckpointedChain(engine, ad, x);
  StepStats s;
  engine.EndStep(s);
  if (stats != nullptr) *stats = s;
  return r;
}

at::Tensor Input(int64_t tokens, int64_t hidden, c10::Device device) {
  at::Generator gen = at::detail::createCPUGenerator(5);
  return at::randn({tokens, hidden}, gen, at::kFloat).to(device);
}

}  // namespace

TEST_CASE("CUDA: streamed equals resident bit for bit, with poison and delayed copies", "[gpu]") {
  const int layers = 6;
  HostBlocks host(TinyStreamConfig(layers), 21, /*read_only=*/true);
  const int64_t hidden = host.manifest().config.hidden_size;
  const ChainAdapter ad = MakeChainAdapter(layers, hidden, 4, 22, kCuda);
  const at::Tensor x = Input(64, hidden, kCuda);
  auto resident = Engine(host, 0, 2, kCuda);
  const ChainResult want = Step(*resident, ad, x);
  REQUIRE(std::isfinite(want.loss));

  for (bool staging : {false, true}) {
    StreamEngineOptions o;
    o.debug_poison = true;
    o.debug_copy_delay_us = 2000;  // a host function sleeping on the copy stream
    o.force_staging = staging;
    for (int ring = 1; ring <= 3; ++ring) {
      for (int swap : {1, 3, layers}) {
        CAPTURE(staging, ring, swap);
        auto engine = Engine(host, swap, ring, kCuda, o);
        for (int step = 0; step < 3; ++step) {
          StepStats s;
          const ChainResult got = Step(*engine, ad, x, &s);
          REQUIRE(BitEqual(got, want));
          REQUIRE(s.h2d_bytes ==
                  static_cast<uint64_t>(s.copies) * host.manifest().blocks[0].nbytes);
          // Each copy holds the copy stream for the 2 ms delay.
          REQUIRE(s.h2d_busy_seconds >= s.copies * 0.0015);
          REQUIRE(s.peak_device_bytes > 0);
        }
      }
    }
  }
}

TEST_CASE("CUDA: a ring of one with slow copies stalls compute, measured by events", "[gpu]") {
  const int layers = 4;
  HostBlocks host(TinyStreamConfig(layers), 23, /*read_only=*/true);
  const int64_t hidden = host.manifest().config.hidden_size;
  const ChainAdapter ad = MakeChainAdapter(layers, hidden, 4, 24, kCuda);
  const at::Tensor x = Input(16, hidden, kCuda);
  StreamEngineOptions o;
  o.debug_copy_delay_us = 5000;
  auto engine = Engine(host, layers, 1, kCuda, o);
  Step(*engine, ad, x);
  StepStats s;
  Step(*engine, ad, x, &s);
  // Steady pass with R = 1: 2 x 4 - 2 copies, each delayed 5 ms on the copy stream while
  // compute waits for it (nothing else to overlap with).
  REQUIRE(s.copies == 6);
  REQUIRE(s.copies_saved == 2);
  REQUIRE(s.h2d_busy_seconds >= 6 * 0.004);
  REQUIRE(s.stall_seconds >= 6 * 0.004);
}

TEST_CASE("CUDA results match the CPU backend's within f32 rounding", "[gpu]") {
  const int layers = 5;
  HostBlocks host(TinyStreamConfig(layers), 25, /*read_only=*/true);
  const int64_t hidden = host.manifest().config.hidden_size;
  auto cpu = Engine(host, 3, 2, c10::Device(c10::kCPU));
  auto gpu = Engine(host, 3, 2, kCuda);
  const ChainResult c = Step(*cpu, MakeChainAdapter(layers, hidden, 4, 26),
                             Input(32, hidden, c10::Device(c10::kCPU)));
  const ChainResult g =
      Step(*gpu, MakeChainAdapter(layers, hidden, 4, 26, kCuda), Input(32, hidden, kCuda));
  REQUIRE(std::abs(c.loss - g.loss) <= 1e-4 * std::abs(c.loss));
  for (int i = 0; i < layers; ++i) {
    REQUIRE(at::allclose(c.grad_a[i], g.grad_a[i].cpu(), 1e-3, 1e-5));
    REQUIRE(at::allclose(c.grad_b[i], g.grad_b[i].cpu(), 1e-3, 1e-5));
  }
}

TEST_CASE(
    "CUDA: phase slots freed and allocated again between phases keep streamed equal to "
    "resident, with poison and delayed copies",
    "[gpu]") {
  const int layers = 7;
  HostBlocks host(TinyStreamConfig(layers), 23, /*read_only=*/true);
  const int64_t hidden = host.manifest().config.hidden_size;
  const ChainAdapter ad = MakeChainAdapter(layers, hidden, 4, 24, kCuda);
  const at::Tensor x = Input(64, hidden, kCuda);
  auto resident = Engine(host, 0, 2, kCuda);
  const ChainResult want = Step(*resident, ad, x);

  for (bool staging : {false, true}) {
    StreamEngineOptions o;
    o.debug_poison = true;
    o.debug_copy_delay_us = 2000;
    o.force_staging = staging;
    o.log_plan = false;
    for (auto [ring, f, b] : {std::tuple{1, 4, 2}, {2, 3, 5}, {2, 6, 6}}) {
      CAPTURE(staging, ring, f, b);
      const ResidencyPlan plan = WithPhaseSlots(PlanFromSwapCount(layers, 6, ring), f, b);
      auto engine = MakeStreamEngine(host.manifest(), host.pointers(), plan, kCuda, o);
      const PassPlan steady = PlanSteadyPass(plan);
      for (int step = 0; step < 4; ++step) {
        StepStats s;
        const ChainResult got = Step(*engine, ad, x, &s);
        REQUIRE(BitEqual(got, want));
        if (step >= 2) REQUIRE(s.copies == steady.copies());
      }
    }
  }
}
