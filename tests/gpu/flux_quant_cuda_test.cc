// FLUX.1 on CUDA from a compressed store: flux-tiny served in bf16 with --quantize fp8 and
// nf4; every unit's linears expanded on the GPU (the CUDA kernels, resident and streamed)
// equal the CPU path's expansion (store/quantize.h's arithmetic) bit for bit, and a job on
// the fp8 store trains on the GPU, streamed and resident, to the losses the same job computes
// on the CPU: within f32 rounding in f32, within bf16 rounding in bf16.
#include "tests/worker/torch_catch.h"  // first: see there

#include <unistd.h>

#include <cmath>
#include <string>
#include <vector>

#include "common/job/flux_job.h"
#include "store/server.h"
#include "tests/support/flux_checkpoint.h"
#include "tests/support/test_support.h"
#include "worker/flux/flux_base.h"
#include "worker/flux/flux_train.h"
#include "worker/model/quant_expand.h"

using namespace lorastream;
using namespace lorastream::worker;
using namespace lorastream::worker::flux;

namespace {

std::unique_ptr<store::PublishedStore> ServeFlux(const std::string& checkpoint,
                                                 QuantMethod method) {
  store::ServeOptions o;
  o.model_dir = checkpoint;
  o.name =
      std::string("test-cuda-flux-") + QuantMethodName(method) + "-" + std::to_string(::getpid());
  o.threads = 2;
  o.lock = false;
  o.quantize = method;
  return store::PublishedStore::Build(o);
}

}  // namespace

TEST_CASE("CUDA: a compressed FLUX store's units expand on the GPU as on the CPU, bit for bit",
          "[gpu]") {
  testing::TempDir dir("cuda-flux-quant-expand");
  const std::string checkpoint = testing::MakeFluxCheckpoint(dir.str() + "/model", "bf16");
  const c10::Device cuda(c10::kCUDA, 0);
  for (QuantMethod method : {QuantMethod::kFp8, QuantMethod::kNf4}) {
    INFO(QuantMethodName(method));
    const auto published = ServeFlux(checkpoint, method);
    const FluxBase base =
        FluxBase::FromStore(published->manifest().store_name, at::kBFloat16, cuda);
    const int units = static_cast<int>(base.layouts().size());
    for (int swap : {0, units}) {
      INFO(swap << " units streamed");
      StreamEngineOptions o;
      o.log_plan = false;
      auto engine = base.MakeEngine(swap, 1, cuda, o);
      engine->BeginStep();
      for (int u = 0; u < units; ++u) {
        const SegmentInfo& layout = base.layouts()[u];
        const at::Tensor host = at::from_blob(const_cast<uint8_t*>(base.unit_bytes()[u]),
                                              {static_cast<int64_t>(layout.nbytes)}, at::kByte);
        at::Tensor cpu_buffer;
        const BlockWeights cpu =
            ExpandBlock(host, layout, at::kBFloat16, &cpu_buffer, BlockNaming::kByName);
        const BlockWeights& gpu = engine->Acquire(u);
        int compressed = 0;
        for (const TensorSlice& t : layout.tensors) {
          if (!t.quant.compressed()) continue;
          INFO("unit " << u << " " << t.name);
          ++compressed;
          REQUIRE(gpu.named.at(t.name).is_cuda());
          REQUIRE(at::equal(gpu.named.at(t.name).cpu(), cpu.named.at(t.name)));
        }
        CHECK(compressed > 0);
        engine->Release(u);
      }
    }
  }
}

TEST_CASE("CUDA: a FLUX job on an fp8 store trains as on the CPU, within rounding", "[gpu]") {
  testing::TempDir dir("cuda-flux-quant-train");
  const auto published =
      ServeFlux(testing::MakeFluxCheckpoint(dir.str() + "/model", "bf16"), QuantMethod::kFp8);
  FluxJob job;
  job.store = published->manifest().store_name;
  job.cache_dir = std::string(LORASTREAM_SOURCE_DIR) + "/configs/data/flux-tiny";
  job.steps = 3;
  job.rank = 4;
  job.alpha = 4;
  job.learning_rate = 1e-3;
  job.ring_size = 1;
  // The CPU computes in f32 with the same expanded (bf16) weights; the GPU in bf16.
  FluxJob cpu_job = job;
  cpu_job.dtype = "f32";
  cpu_job.output_dir = dir.str() + "/out-cpu";
  const std::vector<StepStats> cpu = TrainFlux(cpu_job, {}).steps;
  REQUIRE(cpu.size() == 3);
  FluxTrainOptions options;
  options.device = "cuda";
  // In f32 the GPU computes with the same weights in the same precision: f32 rounding apart;
  // in bf16, bf16 rounding apart.
  for (const char* dtype : {"f32", "bf16"}) {
    for (int swap : {0, 3}) {
      INFO(dtype << ", " << swap << " units streamed");
      FluxJob j = job;
      j.dtype = dtype;
      j.blocks_to_swap = swap;
      j.output_dir = dir.str() + "/out-cuda-" + dtype + "-" + std::to_string(swap);
      const std::vector<StepStats> gpu = TrainFlux(j, options).steps;
      REQUIRE(gpu.size() == 3);
      for (size_t i = 0; i < gpu.size(); ++i) {
        CHECK(std::isfinite(gpu[i].loss));
        CHECK((gpu[i].h2d_bytes > 0) == (swap > 0));
        CHECK(gpu[i].loss == Approx(cpu[i].loss).epsilon(j.dtype == "f32" ? 1e-3 : 2e-2));
      }
    }
  }
}
