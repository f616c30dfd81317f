// The chunked final norm + LM head + cross entropy against the full-logits path (the CPU
// reference), and the streamed LM head against the resident one.
#include "torch_catch.h"  // first: see there

#include <utility>

#include "common/base/error.h"
#include "head_test_util.h"
#include "worker/model/base_weights.h"
#include "worker/model/lm_head.h"
#include "worker/model/lora.h"
#include "worker/model/model.h"
#include "worker/stream/resident_provider.h"
#include "worker/stream/stream_engine.h"
#include "worker/stream/streamed_head.h"
#include "worker_test_util.h"

using namespace lorastream;
using namespace lorastream::worker;

using testing::HeadRun;
using testing::RelativeError;
using testing::RunHead;
using testing::ShiftedTargets;

namespace {

// a equals b within f32 rounding.
void CheckClose(const at::Tensor& a, const at::Tensor& b) {
  REQUIRE(a.sizes() == b.sizes());
  CHECK(b.abs().max().item<double>() > 0);
  CHECK(RelativeError(a, b) <= 2e-5);
}

}  // namespace

TEST_CASE(
    "the chunked LM head's loss and gradients equal the full-logits path within f32 "
    "rounding, for chunks that do and do not divide the rows",
    "[worker]") {
  for (const char* preset : {"tiny", "tiny-qwen2"}) {  // untied and tied
    DYNAMIC_SECTION(preset) {
      testing::TempDir dir("chunked");
      BaseWeights base = BaseWeights::FromCheckpoint(testing::MakeCheckpoint(dir / "m", preset));
      ResidentProvider provider(base, at::kCPU, at::kFloat);
      CausalLm model(base.config(), base.rest(), &provider, at::kCPU, at::kFloat);
      const at::Tensor ids = at::randint(0, base.config().vocab_size, {2, 24}, at::kLong);
      const HeadRun want = RunHead(model, ids, 0);
      // Rows ignored by the loss get no gradient from the head at all.
      const at::Tensor ignored = ShiftedTargets(ids).eq(kIgnoreIndex);
      CHECK(want.hidden_grad.index({ignored}).abs().max().item<double>() == 0);
      for (int64_t rows : {1, 5, 7, 16, 48, 1000}) {  // 48 rows in all
        CAPTURE(rows);
        const HeadRun got = RunHead(model, ids, rows);
        CHECK(got.loss.item<double>() == Approx(want.loss.item<double>()).epsilon(1e-6));
        CheckClose(got.hidden_grad, want.hidden_grad);
        CHECK(at::equal(got.hidden_grad.index({ignored}),
                        at::zeros_like(got.hidden_grad.index({ignored}))));
        REQUIRE(got.grads.size() == want.grads.size());
        for (size_t i = 0; i < got.grads.size(); ++i) {
          CAPTURE(i);
          CheckClose(got.grads[i], want.grads[i]);
        }
      }
      REQUIRE_THROWS_AS(
          ChunkedHeadLossSum(at::zeros({1, 2, base.config().hidden_size}),
                             at::zeros({1, 2}, at::kLong), base.rest().norm, 1e-5,
                             *MakeResidentHead(base.rest().lm_head, at::kCPU, at::kFloat),
                             /*chunk_rows=*/0),
          Error);
      // A wrong target is caught: the same check against another row's gradient fails.
      const HeadRun other = RunHead(model, at::roll(ids, 1, 1), 16);
      CHECK((other.hidden_grad - want.hidden_grad).abs().max().item<double>() >
            1e-3 * want.hidden_grad.abs().max().item<double>());
    }
  }
}

TEST_CASE(
    "a streamed LM head gives the resident head's loss and gradients bit for bit, with "
    "poisoned and delayed copies",
    "[worker]") {
  for (const char* preset : {"tiny", "tiny-qwen2"}) {  // untied and tied (the embedding table)
    DYNAMIC_SECTION(preset) {
      testing::TempDir dir("streamed-head");
      BaseWeights base = BaseWeights::FromCheckpoint(testing::MakeCheckpoint(dir / "m", preset));
      const at::Tensor ids = at::randint(0, base.config().vocab_size, {2, 20}, at::kLong);
      ResidentProvider provider(base, at::kCPU, at::kFloat);
      CausalLm resident(base.config(), base.rest(), &provider, at::kCPU, at::kFloat);
      const HeadRun want = RunHead(resident, ids, 7);
      const HeadRun want_full = RunHead(resident, ids, 0);

      StreamEngineOptions slow;
      slow.debug_poison = true;  // a read before the copy landed would be NaN
      slow.debug_copy_delay_us = 2000;
      // The head from a bf16 copy of the table exercises the one-time conversion too; a
      // prefetched head (its copy issued before the head's use, twice: the second is a no-op)
      // gives the same results from the same single copy.
      for (auto [convert, prefetch] : {std::pair{false, false}, {true, false}, {false, true}}) {
        CAPTURE(convert, prefetch);
        const at::Tensor host =
            convert ? base.rest().lm_head.to(at::kBFloat16) : base.rest().lm_head;
        std::unique_ptr<HeadProvider> head = MakeStreamedHead(host, at::kCPU, at::kFloat, slow);
        REQUIRE(head->streamed());
        RestWeights rest = base.rest();
        rest.lm_head = at::Tensor();  // the head comes from the provider only
        CausalLm streamed(base.config(), rest, &provider, at::kCPU, at::kFloat, head.get());
        auto maybe_prefetch = [&] {
          if (!prefetch) return;
          head->Prefetch();
          head->Prefetch();
        };
        maybe_prefetch();
        const HeadRun got = RunHead(streamed, ids, 7);
        maybe_prefetch();
        const HeadRun got_full = RunHead(streamed, ids, 0);
        if (!convert) {
          CHECK(at::equal(got.loss, want.loss));
          CHECK(at::equal(got.hidden_grad, want.hidden_grad));
          for (size_t i = 0; i < got.grads.size(); ++i)
            CHECK(at::equal(got.grads[i], want.grads[i]));
          CHECK(at::equal(got_full.loss, want_full.loss));
          for (size_t i = 0; i < got.grads.size(); ++i)
            CHECK(at::equal(got_full.grads[i], want_full.grads[i]));
        } else {
          CHECK(std::isfinite(got.loss.item<double>()));
          CHECK(got.loss.item<double>() == Approx(want.loss.item<double>()).epsilon(1e-2));
        }
        // One copy of the head per use (the chunked head and the full logits).
        StepStats stats;
        head->CollectStats(stats);
        const uint64_t head_bytes = base.config().vocab_size * base.config().hidden_size * 4;
        CHECK(stats.copies == 2);
        CHECK(stats.h2d_bytes == 2 * head_bytes);
        CHECK(stats.h2d_busy_seconds >= 2 * 0.002);
      }
    }
  }
}
