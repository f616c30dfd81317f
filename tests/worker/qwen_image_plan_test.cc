// The Qwen-Image planner (torch-free): Qwen-Image's 60 blocks in bf16 and figures shaped like an
// H100's. The estimate's terms scale as qwen_image_plan.h writes them (batch, tokens, rank);
// the chosen plan fits, no fitting plan is predicted faster, none with its ring streams fewer
// blocks; a budget below every block streamed is refused naming the key, the budget and the
// minimum; a group beyond the budget names the job that does not fit; the tokens come from
// the cache files' headers.
#include <catch2/catch.hpp>

#include "common/base/error.h"
#include "common/base/format_bytes.h"
#include "common/formats/manifest.h"
#include "common/formats/qwen_image_cache.h"
#include "store/synth.h"
#include "store/synth_qwen_image.h"
#include "tests/support/flux_cache_files.h"
#include "tests/support/test_support.h"
#include "worker/qwen_image/qwen_image_plan.h"
#include "worker_test_util.h"

using namespace lorastream;
using namespace lorastream::worker;
using namespace lorastream::worker::qwen_image;

namespace {

QwenImageMemoryInputs FullInputs(int64_t batch = 1, int64_t image = 4096, int64_t text = 256,
                                 int64_t rank = 16) {
  QwenImageMemoryInputs in;
  in.config = QwenImageConfig{};  // Qwen-Image
  for (int64_t i = 0; i < in.config.num_layers; ++i)
    in.block_bytes.push_back(
        LayoutSegment(QwenImageUnitShapes(in.config, i), "unit", DType::kBF16, 256).nbytes);
  for (const auto& [name, shape] : QwenImageRestShapes(in.config)) {
    uint64_t n = 2;
    for (int64_t d : shape) n *= static_cast<uint64_t>(d);
    in.rest_bytes += n;
  }
  in.job = {"a", QwenImageLoraParams(in.config, QwenImageTargets({"default"}, "t"), rank), batch,
            image, text};
  return in;
}

StepCosts H100Costs() {
  StepCosts c;
  c.block_forward_seconds = 0.012;
  c.block_backward_seconds = 0.036;
  c.tail_seconds = 0.02;
  c.h2d_bytes_per_second = 25e9;
  return c;
}

}  // namespace

TEST_CASE(
    "qwen_image estimate: each term as the formula writes it, scaling with batch, tokens "
    "and rank",
    "[worker_core][qwen_image]") {
  const QwenImageMemoryInputs in = FullInputs();
  REQUIRE(in.block_bytes.size() == 60);
  CHECK(in.block_bytes[0] / double(1 << 20) == Approx(648).margin(2));
  const uint64_t d = 3072, m = 4 * d, b = 2, blocks = 60, heads = 24;
  const ResidencyPlan plan = DitResidency(QwenImageMemoryModel(in), {10}, 2);
  const DitMemoryEstimate e = EstimateQwenImageMemory(in, plan);
  CHECK(e.resident == 50 * in.block_bytes[0]);
  CHECK(e.ring == 2 * in.block_bytes[0]);
  CHECK(e.rest == in.rest_bytes);
  CHECK(e.reserve == uint64_t{512} << 20);
  const uint64_t t = 4096 + 256;
  CHECK(e.adapter == static_cast<uint64_t>(in.job.lora_params) * 16);
  CHECK(e.checkpoints == blocks * t * d * b + t * 128 * 8);
  CHECK(e.forward_working == t * (b * (6 * d + 2 * m) + 32 * d));
  CHECK(e.backward_working == t * (b * (20 * d + 4 * m) + 32 * d) + 2 * t * d * b);
  CHECK(e.attention == heads * t * 8);
  CHECK(e.total() == std::max(e.forward(), e.backward()));

  // Batch: every activation term doubles but the rotary table (one for the batch).
  const DitMemoryEstimate e2 = EstimateQwenImageMemory(FullInputs(2), plan);
  CHECK(e2.checkpoints - t * 128 * 8 == 2 * (e.checkpoints - t * 128 * 8));
  CHECK(e2.forward_working == 2 * e.forward_working);
  CHECK(e2.backward_working == 2 * e.backward_working);
  CHECK(e2.attention == 2 * e.attention);
  CHECK(e2.adapter == e.adapter);
  // Tokens: linear, but materialised attention quadratic (3b per score).
  const DitMemoryEstimate et = EstimateQwenImageMemory(FullInputs(1, 2 * 4096, 2 * 256), plan);
  CHECK(et.backward_working == 2 * e.backward_working);
  QwenImageMemoryInputs cpu = FullInputs();
  cpu.attention_materialized = true;
  CHECK(EstimateQwenImageMemory(cpu, plan).attention == heads * t * t * 3 * b);
  // Rank: the adapter only (P x 16), P linear in the rank.
  const DitMemoryEstimate er = EstimateQwenImageMemory(FullInputs(1, 4096, 256, 32), plan);
  CHECK(er.adapter == 2 * e.adapter);
  CHECK(er.backward_working == e.backward_working);
  // musubi-tuner's default targets: every linear of a block but the modulations.
  CHECK(in.job.lora_params == 60 * 16 * (8 * 2 * d + 2 * (d + m) + 2 * (m + d)));
  // A compressed store's blocks: copied as stored, one expansion scratch of the largest block's
  // expanded bytes on top; plain blocks have none.
  CHECK(e.expansion == 0);
  QwenImageMemoryInputs fp8 = FullInputs();
  for (uint64_t& bytes : fp8.block_bytes) bytes /= 2;
  fp8.expanded_bytes.assign(60, in.block_bytes[0] - 4096);
  fp8.expanded_bytes[7] = in.block_bytes[0];
  const DitMemoryEstimate ef = EstimateQwenImageMemory(fp8, plan);
  CHECK(ef.expansion == in.block_bytes[0]);
  CHECK(ef.resident == 50 * fp8.block_bytes[0]);
  CHECK(ef.fixed() == e.fixed() - e.resident + ef.resident + in.block_bytes[0]);
}

TEST_CASE(
    "qwen_image planner: the least streaming that fits; too small a budget refused naming "
    "the minimum",
    "[worker_core][qwen_image]") {
  const QwenImageMemoryInputs in = FullInputs();
  const DitMemoryModel model = QwenImageMemoryModel(in);
  const StepCosts costs = H100Costs();
  const uint64_t budget = uint64_t{24} << 30;
  const PlanChoice choice = ChooseQwenImagePlan(in, costs, budget);
  REQUIRE(choice.chosen >= 0);
  const CandidatePlan& chosen = choice.candidates[choice.chosen];
  CHECK(chosen.fits);
  CHECK(chosen.peak_bytes <= budget);
  CHECK(chosen.peak_bytes == EstimateQwenImageMemory(in, chosen.plan).total());
  CHECK(chosen.plan.num_streamed() > 20);  // 38 GiB of blocks in 24 GiB
  CHECK(chosen.plan.num_streamed() < 60);
  for (int swap = 0; swap <= 60; ++swap)
    for (int ring = 1; ring <= 3 && ring <= std::max(1, swap); ++ring) {
      const ResidencyPlan p = DitResidency(model, {swap}, ring);
      if (EstimateQwenImageMemory(in, p).total() > budget) continue;
      INFO("swap " << swap << " ring " << ring);
      CHECK(PredictStep(p, in.block_bytes, costs).step_seconds >=
            chosen.predicted.step_seconds * (1 - kPlanTieFraction));
      if (ring == chosen.plan.ring_size) CHECK(swap >= chosen.plan.num_streamed());
    }
  // Room for every block: none streams.
  const PlanChoice roomy = ChooseQwenImagePlan(in, costs, uint64_t{200} << 30);
  CHECK(roomy.candidates[roomy.chosen].plan.num_streamed() == 0);
  CHECK(DitPlanLabel(model, chosen.plan) == "swap " + std::to_string(chosen.plan.num_streamed()) +
                                                " ring " + std::to_string(chosen.plan.ring_size));

  // Below every block streamed through one slot: refused with the budget and the minimum.
  const uint64_t minimum = EstimateQwenImageMemory(in, DitSmallestPlan(model)).total();
  const uint64_t small = minimum - 1;
  const std::string why =
      lorastream::testing::ErrorMessageOf([&] { ChooseQwenImagePlan(in, costs, small); });
  CHECK_THAT(why, Catch::Contains("stream.gpu_memory_budget " + FormatBytes(small)) &&
                      Catch::Contains("smallest plan's estimate (every unit streamed through "
                                      "one slot): " +
                                      FormatBytes(minimum)));
  CHECK(ChooseQwenImagePlan(in, costs, minimum).candidates.size() > 0);
}

TEST_CASE(
    "qwen_image group: beyond the budget the job that does not fit is named with the "
    "figures",
    "[worker_core][qwen_image]") {
  QwenImageMemoryInputs in = FullInputs();
  const DitMemoryModel model = QwenImageMemoryModel(in);
  const ResidencyPlan smallest = DitSmallestPlan(model);
  const uint64_t alone = EstimateQwenImageMemory(in, smallest).total();
  in.group.push_back({"b", in.job.lora_params, 2, 4096, 256});
  const DitMemoryEstimate both = EstimateQwenImageMemory(in, smallest);
  CHECK(both.ring == EstimateQwenImageMemory(FullInputs(), smallest).ring);
  CHECK(both.adapter == 2 * EstimateQwenImageMemory(FullInputs(), smallest).adapter);
  const uint64_t budget = (alone + both.total()) / 2;
  const std::string why = QwenImageGroupBudgetRefusal(in, budget);
  CHECK_THAT(
      why, Catch::Contains("job b does not fit in the Qwen-Image group beside the 1 before it") &&
               Catch::Contains(std::to_string(both.total() - budget) + " bytes) more than "
                                                                       "stream.gpu_memory_budget"));
  CHECK(QwenImageGroupBudgetRefusal(in, both.total()).empty());
  in.group.clear();
  CHECK(QwenImageGroupBudgetRefusal(in, budget).empty());
}

TEST_CASE(
    "qwen_image group estimate: stacked jobs' working sets and attention add up; one after "
    "another, the largest job's",
    "[worker_core][qwen_image]") {
  QwenImageMemoryInputs in = FullInputs(1, 1024, 256);
  const ResidencyPlan plan = DitSmallestPlan(QwenImageMemoryModel(in));
  const DitMemoryEstimate one = EstimateQwenImageMemory(in, plan);
  in.group.push_back({"b", in.job.lora_params, 1, 1024, 256});
  in.group.push_back({"c", in.job.lora_params, 2, 1024, 256});  // twice a's rows
  const DitMemoryEstimate turns = EstimateQwenImageMemory(in, plan);
  in.group_stacked = true;
  const DitMemoryEstimate stacked = EstimateQwenImageMemory(in, plan);
  // The fixed terms do not depend on how the jobs run.
  CHECK(stacked.fixed() == turns.fixed());
  CHECK(stacked.ring == turns.ring);
  // One after another: c's (the largest) working sets; stacked: a's, b's and c's (4x a's).
  CHECK(turns.forward_working == 2 * one.forward_working);
  CHECK(stacked.forward_working == 4 * one.forward_working);
  CHECK(turns.attention == 2 * one.attention);
  CHECK(stacked.attention == 4 * one.attention);
  // The streams' gradients of b and c (3 x a's rows) are counted once, with the checkpoints.
  const uint64_t grads_per_token = QwenImageMemoryModel(in).stream_grads_per_token;
  CHECK(turns.backward_working == 2 * one.backward_working);
  CHECK(stacked.backward_working == 4 * one.backward_working - 3 * 1280 * grads_per_token);
  CHECK(stacked.total() > turns.total());
}

TEST_CASE("qwen_image plan: a job's tokens are its cache's largest bucket and longest caption",
          "[worker_core][qwen_image]") {
  lorastream::testing::TempDir dir("qi-plan-tokens");
  QwenImageConfig config;
  config.joint_attention_dim = 16;
  WriteQwenImageCacheFiles(dir.str(), "cat", 32, 32, 5, 16, 1);
  WriteQwenImageCacheFiles(dir.str(), "wide", 48, 32, 3, 16, 2);
  WriteQwenImageCacheFiles(dir.str(), "small", 16, 16, 9, 16, 3);
  // 48 x 32 pixels: a 6 x 4 latent, 3 x 2 tokens; the longest caption 9.
  CHECK(QwenImageCacheTokens(dir.str(), config) == std::pair<int64_t, int64_t>{6, 9});
  JobSpec spec;
  spec.name = "q";
  spec.is_qwen_image = true;
  spec.train.batch_size = 3;
  spec.lora.rank = 4;
  spec.lora.targets = {"attention"};
  spec.qwen_image.cache_dir = dir.str();
  const DitJob job = QwenImageDitJob(spec, config);
  CHECK(job.batch == 3);
  CHECK(job.image_tokens == 6);
  CHECK(job.text_tokens == 9);
  CHECK(job.lora_params == config.num_layers * 4 * 8 * 2 * config.hidden());
  // lorastream-synth --caches --flux-cache-size 64x48 --flux-text-tokens 7: one image of 4 x 3
  // tokens, a caption of 7.
  store::SynthOptions o;
  o.flux_cache_pixels = "64x48";
  o.flux_text_tokens = 7;
  store::WriteQwenImageDemoCaches(
      o, std::string(LORASTREAM_SOURCE_DIR) + "/configs/models/qwen-image-tiny.toml",
      dir.str() + "/synth");
  DType preset_dtype;
  const QwenImageConfig tiny = store::LoadQwenImagePreset(
      std::string(LORASTREAM_SOURCE_DIR) + "/configs/models/qwen-image-tiny.toml", &preset_dtype);
  CHECK(QwenImageCacheTokens(dir.str() + "/synth", tiny) == std::pair<int64_t, int64_t>{12, 7});
  o.flux_cache_pixels = "64x40";
  CHECK_THROWS_WITH(
      store::WriteQwenImageDemoCaches(
          o, std::string(LORASTREAM_SOURCE_DIR) + "/configs/models/qwen-image-tiny.toml",
          dir.str() + "/bad"),
      Catch::Contains("--flux-cache-size `64x40`"));
  spec.qwen_image.cache_dir = dir.str() + "/none";
  CHECK_THROWS_WITH(QwenImageDitJob(spec, config), Catch::Contains(dir.str() + "/none"));
}

TEST_CASE(
    "qwen_image plan: an edit job's image stream counts its control images' tokens; the key and "
    "the caches must agree",
    "[worker_core][qwen_image]") {
  lorastream::testing::TempDir dir("qi-plan-edit-tokens");
  QwenImageConfig config;
  config.joint_attention_dim = 16;
  // 32x32 with a 48x32 control: 2 x 2 + 3 x 2 tokens; 48x32 with two 16x16 controls:
  // 3 x 2 + 1 + 1. The largest stream: 10.
  WriteQwenImageCacheFiles(dir.str(), "cat", 32, 32, 5, 16, 1, DType::kBF16, {{48, 32}});
  WriteQwenImageCacheFiles(dir.str(), "wide", 48, 32, 3, 16, 2, DType::kBF16, {{16, 16}, {16, 16}});
  CHECK(QwenImageCacheTokens(dir.str(), config, true) == std::pair<int64_t, int64_t>{10, 5});
  JobSpec spec;
  spec.name = "q";
  spec.is_qwen_image = true;
  spec.train.batch_size = 2;
  spec.lora.rank = 4;
  spec.lora.targets = {"attention"};
  spec.qwen_image.cache_dir = dir.str();
  spec.qwen_image.edit = true;
  const DitJob job = QwenImageDitJob(spec, config);
  CHECK(job.image_tokens == 10);
  CHECK(job.text_tokens == 5);
  // The estimate of the longer stream exceeds the same job's on the image tokens alone.
  QwenImageMemoryInputs in;
  in.config = config;
  in.block_bytes.assign(static_cast<size_t>(config.num_layers), uint64_t{1} << 20);
  in.job = job;
  const ResidencyPlan resident = PlanFromSwapCount(static_cast<int>(config.num_layers), 0, 1);
  const uint64_t edit_total = EstimateQwenImageMemory(in, resident).total();
  in.job.image_tokens = 6;
  CHECK(edit_total > EstimateQwenImageMemory(in, resident).total());
  spec.qwen_image.edit = false;
  CHECK_THROWS_WITH(QwenImageDitJob(spec, config),
                    Catch::Contains("set `qwen_image.edit = true`") &&
                        Catch::Contains(dir.str() + "/cat_0032x0032_qie.safetensors"));
}
