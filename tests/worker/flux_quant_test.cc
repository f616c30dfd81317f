// FLUX.1 on a compressed store (`lorastream-store serve FLUX --quantize fp8|nf4`), on the CPU:
// every unit computes with its linears expanded exactly as a plain reference dequantisation
// (store/quantize.h) gives them, resident (kept compressed, expanded per use) and streamed;
// a job on the store trains, streamed equal to resident bit for bit, copying the compressed
// bytes, and equal to the same job on the checkpoint `lorastream-store dequantize` writes; the
// planner's inputs and cost model count the compressed bytes and the expansion.
#include "tests/worker/torch_catch.h"

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "common/formats/safetensors.h"
#include "common/job/flux_job.h"
#include "store/attach.h"
#include "store/convert.h"
#include "store/dequantize.h"
#include "store/quantize.h"
#include "store/server.h"
#include "tests/support/flux_cache_files.h"
#include "tests/support/flux_checkpoint.h"
#include "tests/support/test_support.h"
#include "tests/worker/worker_test_util.h"
#include "worker/flux/flux_base.h"
#include "worker/flux/flux_calibrate.h"
#include "worker/flux/flux_data.h"
#include "worker/flux/flux_plan.h"
#include "worker/flux/flux_train.h"
#include "worker/model/base_weights.h"
#include "worker/model/quant_expand.h"

using namespace lorastream;
using lorastream::testing::TempDir;
using namespace lorastream::worker;
using namespace lorastream::worker::flux;

namespace {

std::unique_ptr<store::PublishedStore> ServeFlux(const std::string& checkpoint,
                                                 const std::string& name, QuantMethod method) {
  store::ServeOptions o;
  o.model_dir = checkpoint;
  o.name = name + "-" + std::to_string(::getpid());
  o.threads = 2;
  o.lock = false;
  o.quantize = method;
  return store::PublishedStore::Build(o);
}

// The reference: compressed weight `t` of unit `unit` of `store` expanded by store/quantize.h's
// ExpandFp8 / ExpandNf4 over the store's own bytes, as a bf16 tensor of its shape.
at::Tensor ReferenceExpansion(const store::AttachedStore& store, int unit, const TensorSlice& t) {
  auto aux = [&](const std::string& suffix) { return store.tensor_data(unit, t.name + suffix); };
  auto f32 = [&](const std::string& suffix) { return reinterpret_cast<const float*>(aux(suffix)); };
  const int64_t n = t.shape[0] * t.shape[1];
  at::Tensor out = at::empty(t.shape, at::kBFloat16);
  auto* bits = reinterpret_cast<uint16_t*>(out.data_ptr());
  if (t.quant.method == QuantMethod::kFp8) {
    store::ExpandFp8({store.tensor_data(unit, t.name), f32("_scale_inv"), t.shape[0], t.shape[1],
                      t.quant.block_rows, t.quant.block_cols},
                     0, n, bits);
  } else {
    store::ExpandNf4({store.tensor_data(unit, t.name), aux(".absmax"), f32(".nested_absmax"),
                      f32(".quant_map"), f32(".nested_quant_map"), *f32(".nested_offset"), n,
                      t.quant.blocksize, t.quant.nested_blocksize},
                     0, n, bits);
  }
  return out;
}

// Every unit served by `engine` (a forward pass) against `store`: each compressed linear is
// the reference expansion in `dtype`, bit for bit; each other tensor the store's, in `dtype`.
void CheckUnitsExpandExactly(StreamEngine& engine, const store::AttachedStore& store,
                             at::ScalarType dtype) {
  const Manifest& m = store.manifest();
  engine.BeginStep();
  int compressed = 0;
  for (int u = 0; u < engine.num_blocks(); ++u) {
    const BlockWeights& w = engine.Acquire(u);
    for (const TensorSlice& t : m.blocks[u].tensors) {
      INFO("unit " << u << " " << t.name);
      if (t.quant.compressed()) {
        ++compressed;
        const at::Tensor got = w.named.at(t.name);
        CHECK(got.scalar_type() == dtype);
        REQUIRE(at::equal(got, ReferenceExpansion(store, u, t).to(dtype)));
      } else if (t.name.size() > 5 && t.name.compare(t.name.size() - 5, 5, ".bias") == 0) {
        const at::Tensor stored = at::from_blob(const_cast<uint8_t*>(store.tensor_data(u, t.name)),
                                                t.shape, ScalarTypeOf(t.dtype, t.name));
        REQUIRE(at::equal(w.named.at(t.name), stored.to(dtype)));
      }
    }
    engine.Release(u);
  }
  CHECK(compressed == 2 * 10 + 4 * 3);  // flux-tiny: 2 double blocks, 4 single blocks
}

// A flux-tiny job on `store` over DIR/cache: 3 steps, `swap` units streamed through 1 slot.
FluxJob StoreJob(const std::string& dir, const std::string& store, const std::string& out,
                 int swap) {
  FluxJob job;
  job.store = store;
  job.cache_dir = dir + "/cache";
  job.output_dir = dir + "/" + out;
  job.steps = 3;
  job.batch_size = 2;
  job.seed = 5;
  job.rank = 4;
  job.learning_rate = 1e-3;
  job.blocks_to_swap = swap;
  job.ring_size = 1;
  return job;
}

}  // namespace

TEST_CASE(
    "flux on an fp8 or nf4 store: every unit's linears expand as the plain dequantisation, "
    "bit for bit, resident and streamed",
    "[worker][flux][quant]") {
  TempDir dir("flux-quant-expand");
  const std::string checkpoint = lorastream::testing::MakeFluxCheckpoint(dir.str(), "bf16");
  for (QuantMethod method : {QuantMethod::kFp8, QuantMethod::kNf4}) {
    INFO(QuantMethodName(method));
    const auto published = ServeFlux(checkpoint, "test-flux-expand", method);
    const std::string name = published->manifest().store_name;
    const store::AttachedStore store = store::AttachedStore::Attach(name);
    // f32: the bf16 expansion widened; bf16: its bits. A bf16 store computes in either.
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      INFO(c10::toString(dtype));
      const FluxBase base = FluxBase::FromStore(name, dtype, at::kCPU);
      CHECK(base.engine_manifest().dtype == DTypeOf(dtype));
      const int units = static_cast<int>(base.layouts().size());
      CHECK(base.layouts()[0].nbytes == store.manifest().blocks[0].nbytes);  // copied compressed
      StreamEngineOptions o;
      o.log_plan = false;
      o.debug_poison = true;
      // Units stay compressed, resident or in a slot, and expand at each use into one scratch.
      for (int swap : {0, units, 3}) {
        INFO(swap << " units streamed");
        auto engine = base.MakeEngine(swap, 1, at::kCPU, o);
        CheckUnitsExpandExactly(*engine, store, dtype);
        CheckUnitsExpandExactly(*engine, store, dtype);  // a second pass, slots reused
      }
    }
  }
}

TEST_CASE(
    "a FLUX job on an fp8 or nf4 store trains: streamed equals resident bit for bit, copying "
    "the compressed units, and equals the job on the dequantised checkpoint",
    "[worker][flux][quant]") {
  TempDir dir("flux-quant-train");
  const std::string checkpoint = lorastream::testing::MakeFluxCheckpoint(dir.str() + "/model");
  std::filesystem::create_directories(dir.str() + "/cache");
  const FluxCacheShape shape = lorastream::testing::TinyCacheShape();
  lorastream::testing::WriteFluxCache(dir.str() + "/cache", "cat", 32, 32, shape, 1);
  lorastream::testing::WriteFluxCache(dir.str() + "/cache", "dog", 32, 32, shape, 2);
  const auto plain = ServeFlux(checkpoint, "test-flux-train-plain", QuantMethod::kNone);
  const FluxTrainResult plain_base =
      TrainFlux(StoreJob(dir.str(), plain->manifest().store_name, "plain", 3), {});
  REQUIRE(plain_base.steps.size() == 3);
  for (QuantMethod method : {QuantMethod::kFp8, QuantMethod::kNf4}) {
    const std::string format = QuantMethodName(method);
    INFO(format);
    const auto published = ServeFlux(checkpoint, "test-flux-train-" + format, method);
    const std::string name = published->manifest().store_name;
    const FluxTrainResult resident =
        TrainFlux(StoreJob(dir.str(), name, "resident-" + format, 0), {});
    const FluxTrainResult streamed =
        TrainFlux(StoreJob(dir.str(), name, "streamed-" + format, 3), {});
    REQUIRE(resident.steps.size() == 3);
    REQUIRE(streamed.steps.size() == 3);
    for (size_t i = 0; i < 3; ++i) {
      INFO("step " << i);
      CHECK(streamed.steps[i].loss == resident.steps[i].loss);
      CHECK(resident.steps[i].h2d_bytes == 0);
      // The same units streamed, compressed: under a third of the f32 units' bytes.
      CHECK(streamed.steps[i].h2d_bytes > 0);
      CHECK(streamed.steps[i].h2d_bytes * 3 < plain_base.steps[i].h2d_bytes);
      // The compressed base is the f32 base within its rounding: the losses close, not equal.
      CHECK(std::isfinite(resident.steps[i].loss));
      CHECK(resident.steps[i].loss != plain_base.steps[i].loss);
      CHECK(std::fabs(resident.steps[i].loss - plain_base.steps[i].loss) <
            0.05 * std::fabs(plain_base.steps[i].loss));
    }
    CHECK(lorastream::testing::ReadFile(streamed.kohya_path) ==
          lorastream::testing::ReadFile(resident.kohya_path));
    CHECK(lorastream::testing::ReadFile(streamed.diffusers_path) ==
          lorastream::testing::ReadFile(resident.diffusers_path));

    // The same job on the checkpoint `dequantize` writes (the linears expanded by
    // store/quantize.h into a BFL file) trains to the same bits: the store's job computes
    // with exactly the plain dequantisation's weights.
    store::DequantizeOptions dq;
    dq.model_dir = checkpoint;
    dq.out_dir = dir.str() + "/dequantized-" + format;
    dq.quantize = method;
    dq.threads = 2;
    CHECK(store::WriteDequantized(dq).expanded_tensors == 2 * 10 + 4 * 3);
    FluxJob on_checkpoint = StoreJob(dir.str(), "", "dequantized-run-" + format, 0);
    on_checkpoint.checkpoint = dq.out_dir + "/flux1.safetensors";
    const FluxTrainResult dequantized = TrainFlux(on_checkpoint, {});
    REQUIRE(dequantized.steps.size() == 3);
    for (size_t i = 0; i < 3; ++i) CHECK(dequantized.steps[i].loss == resident.steps[i].loss);
    CHECK(lorastream::testing::ReadFile(dequantized.kohya_path) ==
          lorastream::testing::ReadFile(resident.kohya_path));
  }
}

TEST_CASE(
    "the FLUX planner counts a compressed store's bytes as copied, its expanded linears in "
    "memory and its measured expansion per use",
    "[worker][flux][quant]") {
  TempDir dir("flux-quant-plan");
  const std::string checkpoint = lorastream::testing::MakeFluxCheckpoint(dir.str() + "/model");
  std::filesystem::create_directories(dir.str() + "/cache");
  lorastream::testing::WriteFluxCache(dir.str() + "/cache", "cat", 32, 32,
                                      lorastream::testing::TinyCacheShape(), 1);
  const auto fp8 = ServeFlux(checkpoint, "test-flux-plan-fp8", QuantMethod::kFp8);
  const std::string name = fp8->manifest().store_name;
  const FluxBase base = FluxBase::FromStore(name, at::kFloat, at::kCPU);
  FluxJob job = StoreJob(dir.str(), name, "out", 0);
  job.gpu_memory_budget = uint64_t{1} << 40;
  const FluxDataset data(job.cache_dir, base.config());
  const FluxMemoryInputs in = FluxMemoryInputsFor(base, job, data, at::kCPU, at::kFloat);
  REQUIRE(in.unit_bytes.size() == 4);
  REQUIRE(in.expanded_bytes.size() == 4);
  for (size_t u = 0; u < 4; ++u) {
    CHECK(in.unit_bytes[u] == base.layouts()[u].nbytes);  // compressed, as copied
    CHECK(in.expanded_bytes[u] == static_cast<uint64_t>(ExpandedElements(base.layouts()[u])) * 4);
  }
  // Units hold their compressed bytes, in a slot or resident; every use expands into one
  // scratch of the largest unit's expansion.
  const ResidencyPlan all_streamed = FluxResidency(in, 2, 2, 1);
  const ResidencyPlan all_resident = FluxResidency(in, 0, 0, 1);
  FluxMemoryInputs plain_in = in;
  plain_in.expanded_bytes.clear();
  const uint64_t largest_expanded = std::max(in.expanded_bytes[0], in.expanded_bytes[2]);
  for (const ResidencyPlan& plan : {all_streamed, all_resident}) {
    const FluxMemoryEstimate e = EstimateFluxMemory(in, plan);
    const FluxMemoryEstimate plain = EstimateFluxMemory(plain_in, plan);
    CHECK(e.slot == plain.slot);
    CHECK(e.resident == plain.resident);
    CHECK(e.expansion == largest_expanded);
    CHECK(e.total() == plain.total() + largest_expanded);
  }
  CHECK(EstimateFluxMemory(in, all_streamed).slot == std::max(in.unit_bytes[0], in.unit_bytes[2]));

  // The cost model: the expansion measured on the device, each unit's scaled by its size; the
  // prediction adds it at each use that expands (every use but the turnaround's second).
  const StepCosts costs = MeasureFluxCosts(base, job, in, data, at::kCPU, at::kFloat);
  CHECK(costs.block_expand_seconds > 0);
  REQUIRE(costs.block_expand_scale.size() == 4);
  CHECK(costs.block_expand_scale[0] == 1.0);
  CHECK(costs.block_expand_scale[2] ==
        static_cast<double>(in.expanded_bytes[2]) / in.expanded_bytes[0]);
  StepCosts expand_only;
  expand_only.block_expand_seconds = 1.0;
  expand_only.block_expand_scale = {1.0, 1.0, 0.5, 0.25};
  // Forward 0 1 2 3, backward 3 2 1 0: every use expands but the backward's first (unit 3).
  CHECK(PredictStep(all_resident, in.unit_bytes, expand_only).step_seconds ==
        Approx(2 * (1.0 + 1.0 + 0.5) + 0.25));
  const FluxPlanning planning = PlanFluxJob(base, job, data, at::kCPU, at::kFloat);
  const std::string table = DescribeFluxPlanning(planning);
  CHECK_THAT(table, Catch::Contains("compressed linears: copied as stored"));
}

TEST_CASE(
    "a FLUX job on an fp8 checkpoint's store computes with its e4m3 weights exactly and trains, "
    "streamed equal to resident; the checkpoint itself is refused naming the store's command",
    "[worker][flux][quant]") {
  TempDir dir("flux-quant-fp8-file");
  const std::string f32 = lorastream::testing::MakeFluxCheckpoint(dir.str() + "/model");
  const std::string fp8 = dir.str() + "/flux1-fp8.safetensors";
  lorastream::testing::WriteFp8FluxCheckpoint(f32, fp8);
  std::filesystem::create_directories(dir.str() + "/cache");
  lorastream::testing::WriteFluxCache(dir.str() + "/cache", "cat", 32, 32,
                                      lorastream::testing::TinyCacheShape(), 1);
  const auto published = ServeFlux(fp8, "test-flux-fp8-file", QuantMethod::kNone);
  const std::string name = published->manifest().store_name;
  const SafetensorsFile source = SafetensorsFile::Open(fp8);
  const FluxBase base = FluxBase::FromStore(name, at::kFloat, at::kCPU);
  auto engine = base.MakeEngine(0, 1, at::kCPU);
  engine->BeginStep();
  for (int u = 0; u < engine->num_blocks(); ++u) {
    const BlockWeights& w = engine->Acquire(u);
    for (const TensorSlice& t : base.layouts()[u].tensors) {
      if (!t.quant.compressed()) continue;
      INFO(t.name);
      const SafetensorsEntry* e = source.Find(t.name);
      REQUIRE(e != nullptr);
      std::vector<float> want(e->numel());
      for (size_t i = 0; i < want.size(); ++i) want[i] = store::E4M3ToFloat(source.Data(*e)[i]);
      REQUIRE(at::equal(w.named.at(t.name), at::from_blob(want.data(), t.shape, at::kFloat)));
    }
    engine->Release(u);
  }
  FluxJob streamed = StoreJob(dir.str(), name, "streamed", 3), resident = streamed;
  streamed.steps = resident.steps = 2;
  resident.blocks_to_swap = 0;
  resident.output_dir = dir.str() + "/resident";
  const FluxTrainResult a = TrainFlux(streamed, {});
  const FluxTrainResult b = TrainFlux(resident, {});
  REQUIRE(a.steps.size() == 2);
  REQUIRE(b.steps.size() == 2);
  for (size_t i = 0; i < 2; ++i) {
    CHECK(std::isfinite(a.steps[i].loss));
    CHECK(a.steps[i].loss == b.steps[i].loss);
  }
  FluxJob on_checkpoint = StoreJob(dir.str(), "", "checkpoint", 0);
  on_checkpoint.checkpoint = fp8;
  CHECK_THAT(lorastream::testing::ErrorMessageOf([&] { TrainFlux(on_checkpoint, {}); }),
             Catch::Contains("tensor `double_blocks.0.img_mod.lin.weight` is fp8") &&
                 Catch::Contains("lorastream-store serve " + fp8));
}
