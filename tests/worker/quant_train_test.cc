// Training against a compressed store (fp8, nf4) on the CPU: a block's expanded weights
// equal a plain reference dequantisation written here with ATen ops (invariant 7), streamed
// runs equal the resident run bit for bit (invariant 4), and a resumed run ends where an
// uninterrupted one does.
#include "tests/worker/torch_catch.h"  // first: see there

#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <vector>

#include "common/base/error.h"
#include "store/server.h"
#include "tests/worker/quant_reference.h"
#include "tests/worker/worker_test_util.h"
#include "worker/model/base_weights.h"
#include "worker/model/quant_expand.h"
#include "worker/train/stream_provider.h"
#include "worker/train/trainer.h"

using namespace lorastream;
using namespace lorastream::worker;
using testing::ReferenceDequant;

namespace {

struct QuantStore {
  testing::TempDir dir{"quant-train"};
  std::unique_ptr<store::PublishedStore> store;
  QuantStore(const std::string& preset, QuantMethod method) {
    testing::MakeCheckpoint(dir / "m", preset);
    store = testing::ServeForTest(dir / "m", method, QuantMethodName(method));
    testing::WriteJsonl(dir / "d.jsonl", 6, 10, 40, 320);
  }
  JobSpec Job(const std::string& out) const {
    JobSpec spec = testing::TinyJob("", dir / "d.jsonl", dir / out);
    spec.model.checkpoint.clear();
    spec.model.store = store->manifest().store_name;
    spec.train.steps = 4;
    spec.train.grad_accum = 2;
    spec.train.checkpoint_every = 2;
    return spec;
  }
};

TrainOptions Streamed(bool streamed) {
  TrainOptions o;
  o.threads = 1;
  o.device = "cpu";
  if (streamed)
    o.make_provider = [](const JobSpec& j, const BaseWeights& b, const std::string& d,
                         const std::string& t, const std::vector<JobSpec>&) {
      StreamEngineOptions opt;
      opt.log_plan = false;
      opt.debug_poison = true;  // a read before the copy landed would be NaN
      return MakeStreamProvider(j, b, d, t, opt);
    };
  return o;
}

}  // namespace

TEST_CASE("a compressed block expands to its reference dequantisation bit for bit", "[worker]") {
  for (QuantMethod method : {QuantMethod::kFp8, QuantMethod::kNf4}) {
    INFO(QuantMethodName(method));
    QuantStore q("tiny-qwen2", method);
    const BaseWeights base = BaseWeights::FromStore(q.store->manifest().store_name);
    const Manifest& m = *base.manifest();
    const SegmentInfo& layout = m.blocks[1];
    const at::Tensor bytes =
        at::from_blob(const_cast<uint8_t*>(base.block_bytes()[1]),
                      {static_cast<int64_t>(layout.nbytes)}, at::TensorOptions().dtype(at::kByte));
    for (at::ScalarType dtype : {at::kBFloat16, at::kFloat}) {
      at::Tensor buffer;
      const BlockWeights w = ExpandBlock(bytes, layout, dtype, &buffer);
      for (const TensorSlice& t : layout.tensors) {
        const at::Tensor* field = BlockWeightField(w, t.name);
        if (!t.quant.compressed()) {
          if (field != nullptr) CHECK(field->scalar_type() == dtype);  // biases, norms
          continue;
        }
        INFO(t.name);
        const at::Tensor ref = ReferenceDequant(bytes, layout, t);
        REQUIRE(field->scalar_type() == dtype);
        CHECK(at::equal(field->to(at::kBFloat16), ref));  // bf16 exactly, f32 its widening
        CHECK(at::equal(*field, ref.to(dtype)));
      }
      CHECK(buffer.numel() == ExpandedElements(layout));
    }
    // The base's own view of the block (the resident path) is the same expansion.
    CHECK(at::equal(base.block(1).down_proj.to(at::kBFloat16),
                    ReferenceDequant(bytes, layout, *layout.Find("mlp.down_proj.weight"))));
    CHECK(base.block(1).input_norm.scalar_type() == ScalarTypeOf(m.dtype, "the store"));
  }
}

TEST_CASE("training on a compressed store: streamed equals resident bit for bit, resume works",
          "[worker]") {
  for (QuantMethod method : {QuantMethod::kFp8, QuantMethod::kNf4}) {
    INFO(QuantMethodName(method));
    QuantStore q("tiny", method);
    std::vector<double> resident_losses;
    JobSpec spec = q.Job("resident");
    RunTraining(spec, Streamed(false),
                [&](const StepStats& s) { resident_losses.push_back(s.loss); });
    REQUIRE(resident_losses.size() == 4);
    REQUIRE(std::isfinite(resident_losses.back()));
    const std::string want =
        testing::ReadFile(spec.train.output_dir + "/adapter_model.safetensors");
    for (int swap : {0, 3, 4}) {
      for (int ring : {1, 2}) {
        INFO("swap " << swap << " ring " << ring);
        spec = q.Job("s" + std::to_string(swap) + "r" + std::to_string(ring));
        spec.stream.blocks_to_swap = swap;
        spec.stream.ring_size = ring;
        std::vector<double> losses;
        StepStats last;
        RunTraining(spec, Streamed(true), [&](const StepStats& s) {
          losses.push_back(s.loss);
          last = s;
        });
        CHECK(losses == resident_losses);
        CHECK(testing::ReadFile(spec.train.output_dir + "/adapter_model.safetensors") == want);
        // The bytes copied per step are the compressed blocks'.
        CHECK(last.h2d_bytes ==
              static_cast<uint64_t>(last.copies) * q.store->manifest().blocks[0].nbytes);
        CHECK((swap > ring) == (last.copies > 0));
      }
    }
    // Stopped after step 3 and resumed: the same adapter as the uninterrupted run.
    spec = q.Job("split");
    spec.stream.blocks_to_swap = 3;
    int polls = 0;
    TrainResult first = RunTraining(spec, Streamed(true), {}, [&] { return ++polls > 3; });
    CHECK(first.stopped);
    TrainResult second = RunTraining(spec, Streamed(true));
    CHECK(second.start_step == first.steps_done);
    CHECK(second.steps_done == 4);
    CHECK(testing::ReadFile(spec.train.output_dir + "/adapter_model.safetensors") == want);
  }
}

TEST_CASE("compressed blocks stay compressed and expand at each use into one scratch", "[worker]") {
  for (QuantMethod method : {QuantMethod::kFp8, QuantMethod::kNf4}) {
    QuantStore q("tiny-qwen2", method);
    const BaseWeights base = BaseWeights::FromStore(q.store->manifest().store_name);
    const int L = base.num_blocks();
    // Resident, some streamed, all streamed: the slots hold compressed bytes only.
    for (int swap : {0, L - 1, L}) {
      INFO(QuantMethodName(method) << ", " << swap << " streamed");
      JobSpec spec = q.Job("engine");
      spec.stream.blocks_to_swap = swap;
      spec.stream.ring_size = 2;
      StreamEngineOptions opt;
      opt.log_plan = false;
      auto provider = MakeStreamProvider(spec, base, "cpu", "f32", opt);
      for (int step = 0; step < 2; ++step) {
        provider->BeginStep();
        const void* scratch = nullptr;
        for (int pass = 0; pass < 2; ++pass) {  // forward 0..L-1, backward L-1..0
          for (int k = 0; k < L; ++k) {
            const int i = pass == 0 ? k : L - 1 - k;
            const BlockWeights& w = provider->Acquire(i);
            const BlockWeights& want = base.block(i);  // the host's expansion, kept
            CHECK(at::equal(w.q_proj, want.q_proj.to(at::kFloat)));
            CHECK(at::equal(w.down_proj, want.down_proj.to(at::kFloat)));
            CHECK(at::equal(w.q_bias, want.q_bias.to(at::kFloat)));
            // Every use expands into the same buffer: one block's expansion on the device at a
            // time, whether the block is resident or in a slot.
            if (scratch == nullptr) scratch = w.q_proj.data_ptr();
            CHECK(w.q_proj.data_ptr() == scratch);
            provider->Release(i);
          }
        }
        StepStats stats;
        provider->EndStep(stats);
        if (step == 0) CHECK((stats.copies == 0) == (swap == 0));  // later: what the ring kept
      }
    }
  }
}

TEST_CASE("plan names a compressed store's format and what its blocks expand to", "[worker]") {
  QuantStore q("tiny", QuantMethod::kNf4);
  const auto [status, log] = testing::RunPlanOnStore(q.dir.str(), q.store->manifest().store_name);
  INFO(log);
  REQUIRE(status == 0);
  CHECK_THAT(
      log, Catch::Contains(DescribeQuant(StoreQuantFormat(QuantMethod::kNf4)) + ", expanding to "));
}
