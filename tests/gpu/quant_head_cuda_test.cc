// A compressed LM head on the GPU: each vocabulary slice expanded by the CUDA kernels (over
// offset pointers into the head's bytes, resident or streamed) equals the CPU path's slice
// bit for bit, in bf16 and f32; the chunked head over the slices gives a finite loss.
#include "tests/worker/torch_catch.h"  // first: see there

#include <cmath>
#include <filesystem>
#include <fstream>

#include "store/server.h"
#include "tests/worker/head_test_util.h"
#include "tests/worker/worker_test_util.h"
#include "worker/model/base_weights.h"
#include "worker/model/lm_head.h"
#include "worker/model/model.h"
#include "worker/stream/resident_provider.h"
#include "worker/stream/stream_engine.h"
#include "worker/stream/streamed_head.h"

using namespace lorastream;
using namespace lorastream::worker;

TEST_CASE("CUDA: a compressed LM head's slices equal the CPU's bit for bit", "[gpu]") {
  const c10::Device cuda(c10::kCUDA, 0);
  for (QuantMethod method : {QuantMethod::kFp8, QuantMethod::kNf4}) {
    INFO(QuantMethodName(method));
    testing::TempDir dir("cuda-qhead");
    // Hidden 320 (128-tiles that do not divide it; nf4 slices of 256 rows), vocabulary 700
    // (a last slice shorter than the others).
    const std::string checkpoint = testing::MakeCheckpointOfShape(
        dir / "p",
        "model_type = \"qwen3\"\nhidden_size = 320\nintermediate_size = 512\n"
        "num_hidden_layers = 2\nnum_attention_heads = 4\nnum_key_value_heads = 2\n"
        "head_dim = 80\nvocab_size = 700\nmax_position_embeddings = 512\n",
        5);
    const auto published =
        testing::ServeForTest(checkpoint, method, "cuda-qhead", /*quantize_head=*/true);
    const BaseWeights base = BaseWeights::FromStore(published->manifest().store_name);
    const RestWeights& rest = base.rest();
    REQUIRE(rest.packed_head.defined());
    const int64_t align =
        QuantRowAlignment(rest.packed_head.weight().quant, rest.packed_head.cols());
    for (at::ScalarType dtype : {at::kBFloat16, at::kFloat}) {
      auto cpu = MakeResidentHead(rest, at::kCPU, dtype, align);
      auto gpu = MakeResidentHead(rest, cuda, dtype, align);
      StreamEngineOptions opt;
      opt.head_slice_rows = align;
      auto streamed = MakeStreamedHead(rest, cuda, dtype, opt);
      REQUIRE(cpu->num_slices() > 2);
      REQUIRE(gpu->num_slices() == cpu->num_slices());
      cpu->Acquire();
      gpu->Acquire();
      streamed->Acquire();
      for (int64_t i = 0; i < cpu->num_slices(); ++i) {
        INFO("slice " << i << " dtype " << c10::toString(dtype));
        const at::Tensor want = cpu->Slice(i).clone();
        CHECK(at::equal(gpu->Slice(i).cpu(), want));
        CHECK(at::equal(streamed->Slice(i).cpu(), want));
      }
      cpu->Release();
      gpu->Release();
      streamed->Release();
    }
    // The chunked head over the GPU's slices: a finite loss and gradients.
    ResidentProvider blocks(base, cuda, at::kBFloat16);
    const RestWeights on_gpu = RestOnDevice(rest, base.config(), cuda, at::kBFloat16);
    auto head = MakeResidentHead(on_gpu, cuda, at::kBFloat16, align);
    CausalLm model(base.config(), on_gpu, &blocks, cuda, at::kBFloat16, head.get());
    const at::Tensor ids = at::randint(0, base.config().vocab_size, {2, 24}, at::kLong);
    const testing::HeadRun run = testing::RunHead(model, ids, 7);
    CHECK(std::isfinite(run.loss.item<double>()));
    CHECK(at::isfinite(run.hidden_grad).all().item<bool>());
  }
}
