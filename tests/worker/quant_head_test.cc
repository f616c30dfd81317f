// A compressed LM head (`serve --quantize fp8|nf4 --quantize-head`) and embedding table
// (`--quantize-embedding`, or a tied table) in the worker on the CPU: the head's vocabulary
// slices and the embedding's gathered rows equal a plain reference dequantisation bit for bit;
// the chunked head over slices matches the plain head on the dequantised checkpoint within
// f32 rounding (the slice sums reorder the gradient's reduction), a streamed compressed head
// equals the resident one bit for bit, and training on such a store matches training on the
// dequantised checkpoint; the memory estimate counts the compressed bytes.
#include "tests/worker/torch_catch.h"  // first: see there

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <vector>

#include "common/base/error.h"
#include "common/base/format_bytes.h"
#include "store/dequantize.h"
#include "store/server.h"
#include "tests/worker/head_test_util.h"
#include "tests/worker/quant_reference.h"
#include "tests/worker/worker_test_util.h"
#include "worker/model/base_weights.h"
#include "worker/model/lm_head.h"
#include "worker/model/model.h"
#include "worker/stream/resident_provider.h"
#include "worker/stream/stream_budget.h"
#include "worker/stream/stream_engine.h"
#include "worker/stream/streamed_head.h"
#include "worker/train/trainer.h"

using namespace lorastream;
using namespace lorastream::worker;
using testing::HeadRun;
using testing::ReferenceDequant;
using testing::RelativeError;
using testing::RunHead;

namespace {

// A tiny checkpoint (f32) served with its blocks, LM head and embedding compressed.
struct HeadStore {
  testing::TempDir dir{"quant-head"};
  std::string model;
  std::unique_ptr<store::PublishedStore> store;
  HeadStore(const std::string& preset, QuantMethod method) {
    model = testing::MakeCheckpoint(dir / "m", preset);
    store = testing::ServeForTest(model, method, "qhead", /*quantize_head=*/true,
                                  /*quantize_embedding=*/true);
  }
  std::string name() const { return store->manifest().store_name; }
  // `lorastream-store dequantize`'s checkpoint of the same store.
  std::string Dequantized(QuantMethod method) const {
    store::DequantizeOptions d;
    d.model_dir = model;
    d.out_dir = dir / "deq";
    d.quantize = method;
    d.quantize_head = true;
    d.quantize_embedding = true;
    d.threads = 2;
    store::WriteDequantized(d);
    return d.out_dir;
  }
};

int64_t Alignment(const PackedWeight& w) { return QuantRowAlignment(w.weight().quant, w.cols()); }

void CheckSlices(HeadProvider& head, const at::Tensor& want, at::ScalarType dtype) {
  head.Acquire();
  REQUIRE(head.vocab() == want.size(0));
  int64_t rows = 0;
  for (int64_t i = 0; i < head.num_slices(); ++i) {
    INFO("slice " << i);
    const at::Tensor s = head.Slice(i);
    REQUIRE(s.scalar_type() == dtype);
    CHECK(at::equal(s, want.narrow(0, i * head.slice_rows(), s.size(0)).to(dtype)));
    rows += s.size(0);
  }
  CHECK(rows == want.size(0));
  CHECK(at::equal(WholeHead(head), want.to(dtype)));
  head.Release();
}

}  // namespace

TEST_CASE("a compressed LM head's slices and embedding rows equal a plain dequantisation",
          "[worker]") {
  for (const char* preset : {"tiny", "tiny-qwen2"}) {  // untied, tied
    for (QuantMethod method : {QuantMethod::kFp8, QuantMethod::kNf4}) {
      INFO(preset << " " << QuantMethodName(method));
      HeadStore q(preset, method);
      const BaseWeights base = BaseWeights::FromStore(q.name());
      const RestWeights& rest = base.rest();
      REQUIRE(rest.packed_head.defined());
      REQUIRE(rest.packed_embed.defined());
      CHECK_FALSE(rest.lm_head.defined());
      CHECK_FALSE(rest.embed_tokens.defined());
      const PackedWeight& w = rest.packed_head;
      const at::Tensor want = ReferenceDequant(w.bytes, w.layout, w.weight());
      REQUIRE(want.size(0) == base.config().vocab_size);
      const int64_t align = Alignment(w);
      CHECK(align == (method == QuantMethod::kFp8 ? 128 : 256));  // hidden 64
      // Slices of one alignment, of two, and the default (the whole tiny head).
      for (int64_t rows : {align, 2 * align, int64_t{0}}) {
        for (at::ScalarType dtype : {at::kBFloat16, at::kFloat}) {
          INFO("slice rows " << rows);
          auto head = MakeResidentHead(rest, at::kCPU, dtype, rows);
          CHECK(head->num_slices() == (rows == 0 ? 1 : (want.size(0) + rows - 1) / rows));
          CheckSlices(*head, want, dtype);
        }
      }
      // Streamed: the compressed bytes are what is copied, poisoned before they land.
      StreamEngineOptions opt;
      opt.debug_poison = true;
      opt.debug_copy_delay_us = 1000;
      opt.head_slice_rows = align;
      auto streamed = MakeStreamedHead(rest, at::kCPU, at::kFloat, opt);
      CheckSlices(*streamed, want, at::kFloat);
      StepStats stats;
      streamed->CollectStats(stats);
      CHECK(stats.copies == 1);
      CHECK(stats.h2d_bytes == static_cast<uint64_t>(w.bytes.nbytes()));
      CHECK(stats.h2d_bytes < static_cast<uint64_t>(want.nbytes()));
      // A slice that does not start a tile or an absmax group is refused.
      at::Tensor out = at::empty({1, w.cols()}, at::kBFloat16), staging;
      CHECK_THROWS(ExpandPackedRows(w, w.bytes, align / 2, 1, out, &staging));
      // The embedding's rows, gathered on the host.
      const PackedWeight& e = rest.packed_embed;
      const at::Tensor table = ReferenceDequant(e.bytes, e.layout, e.weight());
      const at::Tensor ids = at::randint(0, base.config().vocab_size, {3, 17}, at::kLong);
      CHECK(at::equal(GatherPackedRows(e, ids), at::embedding(table, ids)));
      CHECK_THROWS_AS(GatherPackedRows(e, at::full({1, 1}, base.config().vocab_size, at::kLong)),
                      Error);
    }
  }
}

TEST_CASE(
    "a compressed head matches the dequantised checkpoint's within f32 rounding; streamed "
    "equals resident bit for bit",
    "[worker]") {
  for (const char* preset : {"tiny", "tiny-qwen2"}) {
    for (QuantMethod method : {QuantMethod::kFp8, QuantMethod::kNf4}) {
      INFO(preset << " " << QuantMethodName(method));
      HeadStore q(preset, method);
      const BaseWeights base = BaseWeights::FromStore(q.name());
      const BaseWeights deq = BaseWeights::FromCheckpoint(q.Dequantized(method));
      const at::Tensor ids = at::randint(0, base.config().vocab_size, {2, 24}, at::kLong);
      const int64_t align = Alignment(base.rest().packed_head);

      ResidentProvider plain_blocks(deq, at::kCPU, at::kFloat);
      CausalLm plain(deq.config(), RestOnDevice(deq.rest(), deq.config(), at::kCPU, at::kFloat),
                     &plain_blocks, at::kCPU, at::kFloat);
      const HeadRun want = RunHead(plain, ids, 7);
      const HeadRun want_full = RunHead(plain, ids, 0);

      ResidentProvider blocks(base, at::kCPU, at::kFloat);
      const RestWeights rest = RestOnDevice(base.rest(), base.config(), at::kCPU, at::kFloat);
      auto resident_head = MakeResidentHead(rest, at::kCPU, at::kFloat, align);
      REQUIRE(resident_head->num_slices() > 1);
      CausalLm resident(base.config(), rest, &blocks, at::kCPU, at::kFloat, resident_head.get());
      const HeadRun got = RunHead(resident, ids, 7);
      CHECK(RelativeError(got.loss, want.loss) <= 1e-5);
      CHECK(RelativeError(got.hidden_grad, want.hidden_grad) <= 1e-5);
      REQUIRE(got.grads.size() == want.grads.size());
      for (size_t i = 0; i < got.grads.size(); ++i) {
        CAPTURE(i);
        CHECK(RelativeError(got.grads[i], want.grads[i]) <= 1e-5);
      }
      // The full logits: the whole head expanded once, the same weights.
      const HeadRun got_full = RunHead(resident, ids, 0);
      CHECK(RelativeError(got_full.loss, want_full.loss) <= 1e-6);

      StreamEngineOptions opt;
      opt.debug_poison = true;
      opt.debug_copy_delay_us = 1000;
      opt.head_slice_rows = align;
      auto streamed_head = MakeStreamedHead(rest, at::kCPU, at::kFloat, opt);
      CausalLm streamed(base.config(), rest, &blocks, at::kCPU, at::kFloat, streamed_head.get());
      const HeadRun s = RunHead(streamed, ids, 7);
      CHECK(at::equal(s.loss, got.loss));
      CHECK(at::equal(s.hidden_grad, got.hidden_grad));
      for (size_t i = 0; i < s.grads.size(); ++i) CHECK(at::equal(s.grads[i], got.grads[i]));
    }
  }
}

TEST_CASE("training on a store with a compressed head matches its dequantised checkpoint",
          "[worker]") {
  for (QuantMethod method : {QuantMethod::kFp8, QuantMethod::kNf4}) {
    INFO(QuantMethodName(method));
    HeadStore q("tiny", method);
    testing::WriteJsonl(q.dir / "d.jsonl", 6, 10, 40, 320);
    TrainOptions o;
    o.threads = 1;
    o.device = "cpu";
    o.head_slice_rows = 128;  // several slices of the tiny head
    auto run = [&](JobSpec spec) {
      spec.train.steps = 3;
      std::vector<double> losses;
      RunTraining(spec, o, [&](const StepStats& s) { losses.push_back(s.loss); });
      return losses;
    };
    JobSpec on_store = testing::TinyJob("", q.dir / "d.jsonl", q.dir / "store-out");
    on_store.model.checkpoint.clear();
    on_store.model.store = q.name();
    const std::vector<double> got = run(on_store);
    const std::vector<double> want =
        run(testing::TinyJob(q.Dequantized(method), q.dir / "d.jsonl", q.dir / "deq-out"));
    REQUIRE(got.size() == 3);
    REQUIRE(want.size() == 3);
    for (size_t i = 0; i < got.size(); ++i) {
      INFO("step " << i);
      REQUIRE(std::isfinite(got[i]));
      CHECK(std::fabs(got[i] - want[i]) <= 1e-5 * std::fabs(want[i]));
    }
  }
}

TEST_CASE("the memory estimate counts a compressed head's bytes and its slice scratch",
          "[worker]") {
  HeadStore q("tiny", QuantMethod::kNf4);
  const Manifest& m = q.store->manifest();
  const MemoryModelInputs in = MemoryInputsFor(m, 4, {"q_proj"}, 64, 4, true);
  const TensorSlice* head = m.head();
  REQUIRE(head != nullptr);
  CHECK(in.head_bytes == CompressedSpanBytes(m.rest, *head));
  CHECK(in.head_bytes < static_cast<uint64_t>(head->shape[0] * head->shape[1] * 4));
  CHECK(in.head_slice_rows == HeadSliceRows(head->shape[0], head->shape[1], head->quant));
  const MemoryEstimate e = EstimateMemory(in, PlanFromSwapCount(m.config.num_hidden_layers, 0, 1));
  CHECK(e.head_weights == in.head_bytes);
  CHECK(e.head_scratch > 0);
  CHECK_THAT(e.Describe(), Catch::Contains("slice expansion"));
}

TEST_CASE("plan shows a compressed head's bytes, format and slices", "[worker]") {
  HeadStore q("tiny", QuantMethod::kNf4);
  testing::WriteJsonl(q.dir / "d.jsonl", 6, 10, 40, 320);
  const auto [status, log] = testing::RunPlanOnStore(q.dir.str(), q.name());
  INFO(log);
  REQUIRE(status == 0);
  const Manifest& m = q.store->manifest();
  CHECK_THAT(log, Catch::Contains("LM head " + FormatBytes(CompressedSpanBytes(m.rest, *m.head())) +
                                  " nf4, expanded in slices of 512 rows"));
}
