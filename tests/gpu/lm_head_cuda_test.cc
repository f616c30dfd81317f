// The LM head on CUDA: the embedding table stays in host RAM (only the batch's rows are
// copied), the LM head is streamed from host RAM through a slot of its own with poisoned,
// delayed copies and gives the resident head's results, and the chunked loss and gradients
// equal the full-logits path within f32 rounding.
#include "tests/worker/torch_catch.h"  // first: see there

#include <cmath>

#include "tests/worker/head_test_util.h"
#include "tests/worker/worker_test_util.h"
#include "worker/model/base_weights.h"
#include "worker/model/lm_head.h"
#include "worker/model/lora.h"
#include "worker/model/model.h"
#include "worker/stream/resident_provider.h"
#include "worker/stream/stream_engine.h"
#include "worker/stream/streamed_head.h"

using namespace lorastream;
using namespace lorastream::worker;
using namespace lorastream::testing;

namespace {

const c10::Device kCuda(c10::kCUDA, 0);

}  // namespace

TEST_CASE(
    "CUDA: host embedding, streamed LM head and chunked loss agree with the resident, "
    "full-logits path",
    "[gpu]") {
  for (const char* preset : {"tiny", "tiny-qwen2"}) {  // untied and tied
    DYNAMIC_SECTION(preset) {
      TempDir dir("cuda-head");
      BaseWeights base = BaseWeights::FromCheckpoint(MakeCheckpoint(dir / "m", preset));
      ResidentProvider provider(base, kCuda, at::kFloat);
      at::manual_seed(3);
      const at::Tensor ids = at::randint(0, base.config().vocab_size, {2, 40}, at::kLong);

      // The reference: every non-block weight on the device, the whole sequence's logits.
      RestWeights on_device;
      on_device.embed_tokens = base.rest().embed_tokens.to(kCuda);
      on_device.norm = base.rest().norm.to(kCuda);
      on_device.lm_head = base.rest().lm_head.to(kCuda);
      CausalLm reference(base.config(), on_device, &provider, kCuda, at::kFloat);
      const HeadRun want = RunHead(reference, ids.to(kCuda), 0);
      REQUIRE(std::isfinite(want.loss.item<double>()));

      StreamEngineOptions slow;
      slow.debug_poison = true;
      slow.debug_copy_delay_us = 3000;
      std::unique_ptr<HeadProvider> head =
          MakeStreamedHead(base.rest().lm_head, kCuda, at::kFloat, slow);
      RestWeights host;
      host.embed_tokens = base.rest().embed_tokens;  // host RAM
      host.norm = on_device.norm;
      CausalLm streamed(base.config(), host, &provider, kCuda, at::kFloat, head.get());
      for (int64_t rows : {0, 7, 32, 80}) {
        CAPTURE(rows);
        const HeadRun got = RunHead(streamed, ids, rows);  // ids on the host
        CHECK(got.loss.item<double>() == Approx(want.loss.item<double>()).epsilon(1e-5));
        CHECK(RelativeError(got.hidden_grad, want.hidden_grad) <= 1e-4);
        for (size_t i = 0; i < got.grads.size(); ++i) {
          CAPTURE(i);
          CHECK(RelativeError(got.grads[i], want.grads[i]) <= 1e-4);
        }
      }
      StepStats stats;
      head->CollectStats(stats);
      CHECK(stats.copies == 4);
      CHECK(stats.h2d_busy_seconds > 0);
    }
  }
}
