// The CUDA expansion kernels against the CPU path (store/quantize.h's arithmetic): for an fp8
// and an nf4 store, every compressed projection expanded on the GPU (bf16 and f32) equals the
// CPU's expansion bit for bit; then a job streams the compressed blocks on the GPU and
// trains with finite losses, copying the compressed bytes only (all three blocks streamed
// through one slot, so every use copies); kept resident (compressed, expanded at each use)
// it trains to the same losses.
#include "tests/worker/torch_catch.h"  // first: see there

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "store/server.h"
#include "tests/worker/worker_test_util.h"
#include "worker/model/base_weights.h"
#include "worker/model/quant_expand.h"
#include "worker/train/stream_provider.h"
#include "worker/train/trainer.h"

using namespace lorastream;
using namespace lorastream::worker;

TEST_CASE("CUDA: fp8 and nf4 blocks expand on the GPU to the CPU path's weights bit for bit",
          "[gpu]") {
  for (QuantMethod method : {QuantMethod::kFp8, QuantMethod::kNf4}) {
    INFO(QuantMethodName(method));
    testing::TempDir dir("cuda-quant");
    // Projections of 328 and 900: 128-tiles and 64-value blocks that do not divide them.
    const std::string model = testing::MakeCheckpointOfShape(
        dir / "p",
        "model_type = \"qwen3\"\nhidden_size = 328\nintermediate_size = 900\n"
        "num_hidden_layers = 3\nnum_attention_heads = 4\nnum_key_value_heads = 2\n"
        "head_dim = 82\nvocab_size = 320\nmax_position_embeddings = 512\n",
        5);
    store::ServeOptions o;
    o.model_dir = model;
    o.name = "test-cuda-quant-" + std::to_string(::getpid()) + QuantMethodName(method);
    o.threads = 2;
    o.quantize = method;
    auto published = store::PublishedStore::Build(o);
    const BaseWeights base = BaseWeights::FromStore(o.name);
    for (int b = 0; b < base.num_blocks(); ++b) {
      const SegmentInfo& layout = base.manifest()->blocks[b];
      const at::Tensor host = at::from_blob(const_cast<uint8_t*>(base.block_bytes()[b]),
                                            {static_cast<int64_t>(layout.nbytes)},
                                            at::TensorOptions().dtype(at::kByte));
      const at::Tensor device = host.to(c10::Device(c10::kCUDA, 0));
      for (at::ScalarType dtype : {at::kBFloat16, at::kFloat}) {
        at::Tensor cpu_buffer, gpu_buffer;
        const BlockWeights cpu = ExpandBlock(host, layout, dtype, &cpu_buffer);
        const BlockWeights gpu = ExpandBlock(device, layout, dtype, &gpu_buffer);
        REQUIRE(gpu_buffer.is_cuda());
        CHECK(at::equal(gpu_buffer.cpu(), cpu_buffer));
        CHECK(at::equal(gpu.q_proj.cpu(), cpu.q_proj));
        CHECK(at::equal(gpu.down_proj.cpu(), cpu.down_proj));
        CHECK(at::equal(gpu.q_norm.cpu(), cpu.q_norm));
      }
    }
    // Training on the GPU from the compressed store, two of its blocks streamed.
    testing::WriteJsonl(dir / "d.jsonl", 6, 10, 40, 320);
    JobSpec spec = testing::TinyJob("", dir / "d.jsonl", dir / "out");
    spec.model.checkpoint.clear();
    spec.model.store = o.name;
    spec.stream.blocks_to_swap = 3;
    spec.stream.ring_size = 1;
    TrainOptions t;
    t.device = "cuda:0";
    t.make_provider = [](const JobSpec& j, const BaseWeights& b, const std::string& d,
                         const std::string& ty, const std::vector<JobSpec>& group) {
      return MakeStreamProvider(j, b, d, ty, {}, group);
    };
    std::vector<double> losses;
    StepStats last;
    RunTraining(spec, t, [&](const StepStats& s) {
      losses.push_back(s.loss);
      last = s;
    });
    REQUIRE(losses.size() == 4);
    CHECK(std::isfinite(losses.back()));
    CHECK(last.copies > 0);  // the compressed blocks, whole
    CHECK(last.h2d_bytes == static_cast<uint64_t>(last.copies) * base.manifest()->blocks[0].nbytes);
    // Every block resident, kept compressed and expanded at each use into one scratch: the
    // same losses (the same expansions, the same kernels), nothing copied, less memory.
    spec.train.output_dir = dir / "resident";
    spec.stream.blocks_to_swap = 0;
    std::vector<double> resident;
    StepStats resident_last;
    RunTraining(spec, t, [&](const StepStats& s) {
      resident.push_back(s.loss);
      resident_last = s;
    });
    REQUIRE(resident.size() == 4);
    for (size_t i = 0; i < 4; ++i) CHECK(resident[i] == Approx(losses[i]).epsilon(1e-3));
    CHECK(resident_last.copies == 0);
  }
}
