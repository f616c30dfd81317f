// The per-step adapter casts (LoraCastCache, worker/block.h) against CastLoraBlock: a check
// the CPU tests (tests/worker/model_test.cc) and the CUDA tests (tests/gpu) both run.
#pragma once

#include "tests/worker/torch_catch.h"  // first: see there

#include <vector>

#include <c10/core/GradMode.h>

#include "worker/adamw.h"
#include "worker/block.h"
#include "worker/lora.h"

namespace lorastream::testing {

// Every block's cached cast equals CastLoraBlock of the adapter's current masters, bit for
// bit: when first built, after an AdamW step (in-place updates), and after a block's tensor
// is replaced. Fails on a cast that misses an update.
inline void RequireCastsFollowUpdates(const ModelConfig& config,
                                      const worker::LoraSettings& settings,
                                      c10::ScalarType dtype, c10::Device device) {
  using namespace lorastream::worker;
  LoraAdapter adapter = LoraAdapter::Init(config, settings, 3, device);
  {
    c10::NoGradGuard no_grad;
    for (auto& p : adapter.Params()) p.normal_();  // B too: every value distinct
  }
  LoraCastCache cache;
  auto require_fresh = [&] {
    for (int b = 0; b < adapter.num_blocks(); ++b) {
      CAPTURE(b);
      const LoraBlockCast want = CastLoraBlock(adapter.block(b), dtype);
      const LoraBlockCast& got = cache.Block(adapter, b, dtype);
      for (int t = 0; t < kNumLoraTargets; ++t) {
        CAPTURE(t);
        REQUIRE(got.lora.a[t].defined() == want.lora.a[t].defined());
        if (!want.lora.a[t].defined()) continue;
        REQUIRE(got.lora.a[t].scalar_type() == dtype);
        REQUIRE(at::equal(got.lora.a[t], want.lora.a[t]));
        REQUIRE(at::equal(got.lora.b[t], want.lora.b[t]));
      }
      for (int g = 0; g < kNumGroups; ++g) {
        CAPTURE(g);
        REQUIRE(got.stacked[g].defined() == want.stacked[g].defined());
        if (want.stacked[g].defined()) REQUIRE(at::equal(got.stacked[g], want.stacked[g]));
      }
    }
  };
  require_fresh();
  // AdamW updates the masters in place: every block sees the new values.
  const std::vector<at::Tensor> params = adapter.Params();
  for (const auto& p : params) p.mutable_grad() = at::ones_like(p);
  AdamW optimizer(params, AdamWOptions{});
  optimizer.Step(0.5);
  require_fresh();
  // A block's tensor replaced (a loaded adapter): the buffers follow it.
  {
    c10::NoGradGuard no_grad;
    int t = 0;
    while (!adapter.block(1).a[t].defined()) ++t;
    adapter.block(1).a[t] = adapter.block(1).a[t] * 3;
  }
  require_fresh();
}

}  // namespace lorastream::testing
