// The streaming engine on its CPU backend: streamed runs equal resident runs bit for bit for
// every ring size and swap count (invariant 4), also with a slowed, poisoning copy thread
// (invariants 1 and 2: a reader never sees a poisoned or partial slot), base weights are never
// written (invariant 3: the host blocks are mapped read-only, so a write would fault), blocks
// still in a slot are not copied again (invariant 5, by the copy statistics), and misuse is
// refused.
#include <algorithm>
#include <future>
#include <tuple>

#include <ATen/ATen.h>
#include <catch2/catch.hpp>

#include "common/base/error.h"
#include "tests/worker/stream_chain.h"
#include "tests/worker/stream_test_blocks.h"
#include "worker/stream/stream_cpu_backend.h"
#include "worker/stream/stream_engine.h"

using namespace lorastream;
using namespace lorastream::worker;
using namespace lorastream::testing;

namespace {

constexpr int64_t kTokens = 6;

std::unique_ptr<StreamEngine> Engine(const HostBlocks& host, int swap, int ring,
                                     const StreamEngineOptions& options = {}) {
  StreamEngineOptions o = options;
  o.log_plan = false;
  return MakeStreamEngine(host.manifest(), host.pointers(),
                          PlanFromSwapCount(host.manifest().config.num_hidden_layers, swap, ring),
                          c10::Device(c10::kCPU), o);
}

// The same engine on a CPU backend the test keeps a handle on (`*backend`, owned by the
// engine), to wait for the copy thread.
std::unique_ptr<StreamEngine> EngineOnCpu(const HostBlocks& host, int swap, int ring,
                                          const StreamEngineOptions& options,
                                          CpuStreamBackend** backend) {
  const ResidencyPlan plan =
      PlanFromSwapCount(host.manifest().config.num_hidden_layers, swap, ring);
  auto owned =
      std::make_unique<CpuStreamBackend>(StreamBackendOptionsFor(host.manifest(), plan, options));
  *backend = owned.get();
  return std::make_unique<StreamEngine>(host.manifest(), host.pointers(), plan, std::move(owned),
                                        /*log_plan=*/false);
}

at::Tensor Input(int64_t hidden, uint64_t seed) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  return at::randn({kTokens, hidden}, gen, at::kFloat);
}

// The block's weights as the host holds them (the reference for what a reader must see).
BlockWeights HostView(const HostBlocks& host, int block) {
  const SegmentInfo& s = host.manifest().blocks[block];
  at::Tensor bytes = at::from_blob(const_cast<uint8_t*>(host.pointers()[block]),
                                   {static_cast<int64_t>(s.nbytes)}, at::kByte);
  return BlockWeightsFromBytes(bytes, s);
}

bool SameWeights(const BlockWeights& a, const BlockWeights& b) {
  for (auto field : {&BlockWeights::input_norm, &BlockWeights::q_proj, &BlockWeights::k_proj,
                     &BlockWeights::v_proj, &BlockWeights::o_proj, &BlockWeights::post_norm,
                     &BlockWeights::gate_proj, &BlockWeights::up_proj, &BlockWeights::down_proj}) {
    if (!BitEqual(a.*field, b.*field)) return false;
  }
  return true;
}

}  // namespace

TEST_CASE("streamed runs equal the resident run bit for bit, every ring and swap count",
          "[worker]") {
  const int layers = 5;
  HostBlocks host(TinyStreamConfig(layers), 7, /*read_only=*/true);
  const int64_t hidden = host.manifest().config.hidden_size;
  const ChainAdapter ad = MakeChainAdapter(layers, hidden, 4, 11);
  const at::Tensor x0 = Input(hidden, 3);

  auto resident = Engine(host, 0, 2);
  const ChainResult want = RunCheckpointedChain(*resident, ad, x0);
  REQUIRE(std::isfinite(want.loss));

  for (int ring = 1; ring <= 3; ++ring) {
    for (int swap = 0; swap <= layers; ++swap) {
      CAPTURE(ring, swap);
      auto engine = Engine(host, swap, ring);
      for (int step = 0; step < 3; ++step) {  // cold pass, then steady passes
        engine->BeginStep();
        const ChainResult got = RunCheckpointedChain(*engine, ad, x0);
        StepStats stats;
        engine->EndStep(stats);
        REQUIRE(BitEqual(got, want));
      }
    }
  }
}

TEST_CASE("a slowed, poisoning copy thread changes nothing: compute waits for every copy",
          "[worker]") {
  const int layers = 4;
  HostBlocks host(TinyStreamConfig(layers), 8, /*read_only=*/true);
  const int64_t hidden = host.manifest().config.hidden_size;
  const ChainAdapter ad = MakeChainAdapter(layers, hidden, 4, 12);
  const at::Tensor x0 = Input(hidden, 4);
  auto resident = Engine(host, 0, 2);
  const ChainResult want = RunCheckpointedChain(*resident, ad, x0);

  StreamEngineOptions slow;
  slow.debug_poison = true;
  slow.debug_copy_delay_us = 3000;
  for (int ring = 1; ring <= 3; ++ring) {
    for (int swap : {1, 3, 4}) {
      CAPTURE(ring, swap);
      CpuStreamBackend* backend = nullptr;
      auto engine = EngineOnCpu(host, swap, ring, slow, &backend);
      int inspected = 0;
      bool hold = false;
      // What the compute read is exactly the host's block, both when it acquired it (with the
      // slowed copies still in flight: invariant 1) and, on the second step, after holding it
      // until the copy thread has run every copy issued so far (invariant 2: a copy into the
      // held slot is refused, which Drain rethrows, or shows in the second comparison). The
      // first step does not wait, so that its acquires meet copies in flight.
      auto inspect = [&](int block, const BlockWeights& w) {
        REQUIRE(SameWeights(w, HostView(host, block)));
        if (hold) backend->Drain();
        REQUIRE(SameWeights(w, HostView(host, block)));
        ++inspected;
      };
      for (int step = 0; step < 2; ++step) {
        hold = step == 1;
        engine->BeginStep();
        const ChainResult got = RunCheckpointedChain(*engine, ad, x0, inspect);
        StepStats stats;
        engine->EndStep(stats);
        REQUIRE(BitEqual(got, want));
        if (stats.copies > 0) {
          // Each copy sleeps 3 ms inside the copy engine's busy time.
          REQUIRE(stats.h2d_busy_seconds >= stats.copies * 0.003);
        }
      }
      REQUIRE(inspected == 2 * 2 * layers);
    }
  }
}

TEST_CASE("the poison is visible: a slot read before its copy lands holds NaN", "[worker]") {
  // The detector behind the test above: the copy is held between poison and copy while the
  // test reads the slot.
  std::promise<void> poisoned, go_on;
  std::shared_future<void> gate = go_on.get_future().share();
  StreamBackendOptions o;
  o.num_slots = 1;
  o.slot_bytes = 1024;
  o.debug_poison = true;
  o.debug_after_poison = [&poisoned, gate](int) {
    poisoned.set_value();
    gate.wait();
  };
  CpuStreamBackend backend(o);
  std::vector<float> src(256, 1.5f);
  backend.Copy(0, reinterpret_cast<const uint8_t*>(src.data()), 1024);
  poisoned.get_future().wait();
  const at::Tensor early = backend.slot(0).view(at::kFloat);
  const bool all_nan = at::isnan(early).all().item<bool>();
  go_on.set_value();  // let the copy finish before any REQUIRE can leave this scope
  REQUIRE(all_nan);   // read without AcquireSlot: poison
  backend.AcquireSlot(0);
  REQUIRE(at::equal(backend.slot(0).view(at::kFloat), at::full({256}, 1.5f)));
  backend.ReleaseSlot(0);
}

TEST_CASE("the CPU backend refuses a copy into a slot that is still being read", "[worker]") {
  StreamBackendOptions o;
  o.num_slots = 2;
  o.slot_bytes = 64;
  CpuStreamBackend backend(o);
  std::vector<uint8_t> src(64, 1);
  backend.Copy(0, src.data(), 64);
  backend.AcquireSlot(0);
  backend.Copy(0, src.data(), 64);  // a ring bug: slot 0 has not been released
  try {
    backend.Drain();
    FAIL("overwrite of a slot in use went unnoticed");
  } catch (const Error& e) {
    REQUIRE(e.code() == ErrorCode::kInternal);
    REQUIRE(std::string(e.what()).find("invariant 2") != std::string::npos);
  }
}

TEST_CASE("copies per step: reuse at the turnaround and across passes", "[worker]") {
  const int layers = 6;
  HostBlocks host(TinyStreamConfig(layers), 9, /*read_only=*/true);
  const int64_t hidden = host.manifest().config.hidden_size;
  const uint64_t block_bytes = host.manifest().blocks[0].nbytes;
  const ChainAdapter ad = MakeChainAdapter(layers, hidden, 2, 13);
  const at::Tensor x0 = Input(hidden, 5);
  auto engine = Engine(host, 6, 2);

  StepStats s1, s2, s3;
  engine->BeginStep();
  RunCheckpointedChain(*engine, ad, x0);
  engine->EndStep(s1);
  // Cold: 6 forward copies, the backward reuses blocks 5 and 4 and copies 3..0.
  REQUIRE(s1.copies == 10);
  REQUIRE(s1.copies_saved == 2);
  REQUIRE(s1.h2d_bytes == 10 * block_bytes);

  engine->BeginStep();
  RunCheckpointedChain(*engine, ad, x0);
  engine->EndStep(s2);
  // Steady: blocks 0 and 1 are still in the ring from the previous backward.
  REQUIRE(s2.copies == 8);
  REQUIRE(s2.copies_saved == 4);
  REQUIRE(s2.h2d_bytes == 8 * block_bytes);

  // Gradient accumulation: two passes in one step.
  engine->BeginStep();
  RunCheckpointedChain(*engine, ad, x0);
  RunCheckpointedChain(*engine, ad, x0);
  engine->EndStep(s3);
  REQUIRE(s3.copies == 16);
  REQUIRE(s3.copies_saved == 8);

  // Everything resident: no copies at all.
  auto resident = Engine(host, 0, 2);
  StepStats r;
  resident->BeginStep();
  RunCheckpointedChain(*resident, ad, x0);
  resident->EndStep(r);
  REQUIRE(r.copies == 0);
  REQUIRE(r.h2d_bytes == 0);
}

TEST_CASE("a step begun in the middle of a pass restarts cleanly", "[worker]") {
  const int layers = 5;
  HostBlocks host(TinyStreamConfig(layers), 10, /*read_only=*/true);
  const int64_t hidden = host.manifest().config.hidden_size;
  const ChainAdapter ad = MakeChainAdapter(layers, hidden, 2, 14);
  const at::Tensor x0 = Input(hidden, 6);
  auto resident = Engine(host, 0, 2);
  const ChainResult want = RunCheckpointedChain(*resident, ad, x0);

  StreamEngineOptions slow;
  slow.debug_poison = true;
  slow.debug_copy_delay_us = 1000;
  auto engine = Engine(host, 4, 2, slow);
  engine->BeginStep();
  for (int i = 0; i < 3; ++i) {  // a forward-only pass abandoned after three blocks
    engine->Acquire(i);
    engine->Release(i);
  }
  engine->Acquire(3);  // ... even with a block still acquired
  engine->BeginStep();
  REQUIRE(BitEqual(RunCheckpointedChain(*engine, ad, x0), want));
}

TEST_CASE("the engine refuses calls out of the step's order", "[worker]") {
  HostBlocks host(TinyStreamConfig(3), 11, /*read_only=*/true);
  auto engine = Engine(host, 3, 2);
  engine->BeginStep();
  REQUIRE_THROWS_AS(engine->Acquire(1), Error);  // the pass starts with block 0
  REQUIRE_THROWS_AS(engine->Release(0), Error);  // nothing acquired
  engine->Acquire(0);
  REQUIRE_THROWS_AS(engine->Acquire(0), Error);  // still acquired
  REQUIRE_THROWS_AS(engine->Release(1), Error);  // not the acquired block
  engine->Release(0);
  try {
    engine->Acquire(2);
    FAIL("out-of-order Acquire accepted");
  } catch (const Error& e) {
    REQUIRE(e.code() == ErrorCode::kInternal);
    REQUIRE(std::string(e.what()).find("forward of block 1") != std::string::npos);
  }
}

TEST_CASE("bad construction arguments are refused", "[worker]") {
  HostBlocks host(TinyStreamConfig(3), 12, /*read_only=*/true);
  const ResidencyPlan plan = PlanFromSwapCount(3, 2, 2);
  std::vector<const uint8_t*> too_few(host.pointers().begin(), host.pointers().end() - 1);
  REQUIRE_THROWS_AS(MakeStreamEngine(host.manifest(), too_few, plan, c10::Device(c10::kCPU)),
                    Error);
  std::vector<const uint8_t*> null_block = host.pointers();
  null_block[1] = nullptr;
  REQUIRE_THROWS_AS(MakeStreamEngine(host.manifest(), null_block, plan, c10::Device(c10::kCPU)),
                    Error);
  Manifest bad = host.manifest();
  bad.blocks[2].tensors.back().offset = bad.blocks[2].nbytes;  // outside its segment
  REQUIRE_THROWS_AS(MakeStreamEngine(bad, host.pointers(), plan, c10::Device(c10::kCPU)), Error);
}

TEST_CASE("a trainable base weight is refused naming the tensor", "[worker]") {
  HostBlocks host(TinyStreamConfig(2), 13, /*read_only=*/false);
  BlockWeights w = HostView(host, 1);
  RefuseTrainableBaseWeights(w, 1);  // frozen: fine
  w.up_proj = w.up_proj.clone().requires_grad_(true);
  try {
    RefuseTrainableBaseWeights(w, 1);
    FAIL("trainable base weight accepted");
  } catch (const Error& e) {
    REQUIRE(e.code() == ErrorCode::kRefused);
    REQUIRE(std::string(e.what()).find("model.layers.1.mlp.up_proj.weight") != std::string::npos);
  }
  REQUIRE_THROWS_AS(RefuseTrainableBaseWeight(at::ones({2}).requires_grad_(true), "lm_head.weight"),
                    Error);
}

TEST_CASE("residency from a job's stream settings", "[worker]") {
  HostBlocks host(TinyStreamConfig(4), 14, /*read_only=*/false);
  const MemoryModelInputs in = MemoryInputsFor(host.manifest(), 4, {"q_proj", "down_proj"}, kTokens,
                                               4, /*attention_materialized=*/true);
  REQUIRE(PlanResidency(2, 0, 2, in).num_streamed() == 2);
  REQUIRE(PlanResidency(2, ~uint64_t{0} >> 1, 2, in).num_streamed() == 0);  // budget wins
  REQUIRE_THROWS_AS(PlanResidency(2, 1000, 2, in), Error);                  // below minimum
  REQUIRE_THROWS_AS(PlanResidency(2, 0, 0, in), Error);                     // ring 0
  REQUIRE_THROWS_AS(PlanResidency(5, 0, 2, in), Error);                     // too many blocks
}

TEST_CASE(
    "phase slots: streamed equals resident bit for bit over several steps, the "
    "device never holds more slots than the phase has",
    "[worker]") {
  const int layers = 7;
  HostBlocks host(TinyStreamConfig(layers), 15, /*read_only=*/true);
  const int64_t hidden = host.manifest().config.hidden_size;
  const ChainAdapter ad = MakeChainAdapter(layers, hidden, 3, 16);
  const at::Tensor x0 = Input(hidden, 7);
  auto resident = Engine(host, 0, 2);
  const ChainResult want = RunCheckpointedChain(*resident, ad, x0);

  StreamEngineOptions slow;
  slow.debug_poison = true;
  slow.debug_copy_delay_us = 1500;
  for (int swap : {3, 5, 7}) {
    for (int ring : {1, 2}) {
      // Slots in the forward, across the LM head (0: the ring) and in the backward.
      for (auto [f, h, b] :
           {std::tuple{4, 0, 2}, {2, 0, 4}, {2, 3, 4}, {2, 4, 4}, {5, 5, 5}, {3, 0, 1}}) {
        CAPTURE(swap, ring, f, h, b);
        const ResidencyPlan plan = WithPhaseSlots(PlanFromSwapCount(layers, swap, ring),
                                                  std::max(f, ring), std::max(b, ring), h);
        StreamBackendOptions bo;
        bo.num_slots = plan.max_slots();
        bo.permanent_slots = plan.ring_size;
        bo.slot_bytes = host.manifest().blocks[0].nbytes;
        bo.debug_poison = slow.debug_poison;
        bo.debug_copy_delay_us = slow.debug_copy_delay_us;
        auto backend = std::make_unique<CpuStreamBackend>(bo);
        CpuStreamBackend* device = backend.get();
        StreamEngine engine(host.manifest(), host.pointers(), plan, std::move(backend),
                            /*log_plan=*/false);
        int calls = 0;
        auto inspect = [&](int block, const BlockWeights& w) {
          // What the compute reads is the host's block (invariants 1 and 2), and the slots
          // allocated now are within the phase's count.
          REQUIRE(SameWeights(w, HostView(host, block)));
          const bool backward = calls++ % (2 * layers) >= layers;
          REQUIRE(device->live_slots() <= (backward ? plan.backward_slots : plan.forward_slots));
        };
        // At the LM head only its slots exist.
        auto turnaround = [&] { REQUIRE(device->live_slots() <= plan.head_slots); };
        const PassPlan steady = PlanSteadyPass(plan);
        for (int step = 0; step < 4; ++step) {
          engine.BeginStep();
          const ChainResult got = RunCheckpointedChain(engine, ad, x0, inspect, turnaround);
          StepStats stats;
          engine.EndStep(stats);
          REQUIRE(BitEqual(got, want));
          // From the second step on, the blocks the backward left in the slots serve the
          // next forward without a copy (invariant 5): the steady plan's count.
          if (step >= 2) REQUIRE(stats.copies == steady.copies());
        }
        REQUIRE(device->max_live_slots() <= plan.max_slots());
        // Where the plan copies into a phase slot, the device did allocate one.
        const bool phase_copy =
            std::any_of(steady.uses.begin(), steady.uses.end(),
                        [&](const BlockUse& u) { return u.copy && u.slot >= plan.ring_size; });
        if (phase_copy) REQUIRE(device->max_live_slots() > plan.ring_size);
      }
    }
  }
}

TEST_CASE("phase slots: more slots copy less, across the step boundary", "[worker]") {
  const int layers = 8;
  HostBlocks host(TinyStreamConfig(layers), 17, /*read_only=*/true);
  const int64_t hidden = host.manifest().config.hidden_size;
  const ChainAdapter ad = MakeChainAdapter(layers, hidden, 2, 18);
  const at::Tensor x0 = Input(hidden, 8);
  auto run_steady = [&](const ResidencyPlan& plan) {
    StreamEngineOptions o;
    o.log_plan = false;
    auto engine =
        MakeStreamEngine(host.manifest(), host.pointers(), plan, c10::Device(c10::kCPU), o);
    StepStats s;
    for (int step = 0; step < 3; ++step) {
      engine->BeginStep();
      RunCheckpointedChain(*engine, ad, x0);
      engine->EndStep(s);
    }
    return s;
  };
  const StepStats ring2 = run_steady(PlanFromSwapCount(layers, 8, 2));
  const StepStats timeline = run_steady(WithPhaseSlots(PlanFromSwapCount(layers, 8, 2), 4, 3));
  REQUIRE(ring2.copies == 12);     // 2 x 8 - 2 (turnaround) - 2 (pass boundary)
  REQUIRE(timeline.copies == 11);  // the pass boundary keeps 3
  REQUIRE(timeline.copies_saved == 5);
  REQUIRE(timeline.h2d_bytes < ring2.h2d_bytes);
}
