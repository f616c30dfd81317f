#include "common/formats/flux_cache.h"

#include <algorithm>
#include <functional>

#include <catch2/catch.hpp>

#include "common/base/error.h"
#include "common/formats/flux_config.h"
#include "common/formats/safetensors.h"
#include "tests/support/flux_cache_files.h"
#include "tests/support/test_support.h"

using namespace lorastream;
using lorastream::testing::ErrorMessageOf;
using lorastream::testing::TempDir;
using lorastream::testing::WriteFluxCache;

namespace {

FluxConfig Tiny() {
  FluxConfig c;
  c.hidden_size = 64;
  c.num_heads = 4;
  c.axes_dim = {4, 6, 6};
  c.depth = 2;
  c.depth_single = 3;
  c.mlp_hidden = 256;
  c.vec_in_dim = 32;
  c.context_in_dim = 48;
  return c;
}

// A BFL-named file of `config`'s tensors (zeros), with `edit` applied to the tensor list.
std::string WriteBfl(const std::string& path, const FluxConfig& config,
                     const std::function<void(std::vector<TensorToWrite>&)>& edit = {}) {
  static std::vector<float> zeros(1 << 16);
  std::vector<TensorToWrite> t;
  for (const auto& [name, shape] : FluxAllShapes(config))
    t.push_back({name, DType::kF32, shape, zeros.data()});
  if (edit) edit(t);
  WriteSafetensors(path, t, FluxMetadata(config));
  return path;
}

}  // namespace

TEST_CASE("flux cache: images pair with their text files and batch by bucket", "[common][flux]") {
  TempDir dir("flux-cache");
  const FluxCacheShape s = lorastream::testing::TinyCacheShape();
  WriteFluxCache(dir.str(), "a", 64, 32, s, 1);
  WriteFluxCache(dir.str(), "b", 64, 32, s, 2, /*compressed=*/true);
  WriteFluxCache(dir.str(), "c", 32, 32, s, 3);
  const auto items = ScanFluxCache(dir.str());
  REQUIRE(items.size() == 3);
  const auto buckets = FluxBuckets(items);
  REQUIRE(buckets.size() == 2);
  CHECK(buckets.at({32, 64}).size() == 2);
  CHECK(buckets.at({32, 32}).size() == 1);
  const FluxSample a = LoadFluxSample(items[0], 16, 48, 32);
  CHECK(a.latent_h == 4);
  CHECK(a.latent_w == 8);
  CHECK(a.latents.size() == 16u * 4 * 8);
  CHECK(a.t5_out.size() == 8u * 48);
  CHECK(a.l_pooled.size() == 32u);
  CHECK(LoadFluxSample(items[1], 16, 48, 32).latents.size() == 16u * 4 * 8);  // deflated
}

TEST_CASE("flux cache: a missing text file, wrong widths and channel counts name the file",
          "[common][flux]") {
  TempDir dir("flux-cache-bad");
  const FluxCacheShape s = lorastream::testing::TinyCacheShape();
  WriteFluxCache(dir.str(), "ok", 32, 32, s, 1);
  const auto items = ScanFluxCache(dir.str());
  std::string e = ErrorMessageOf([&] { LoadFluxSample(items[0], 4, 48, 32); });
  CHECK_THAT(e, Catch::Contains(items[0].latents_path));
  CHECK_THAT(e, Catch::Contains("expected [4, 4, 4]"));
  e = ErrorMessageOf([&] { LoadFluxSample(items[0], 16, 4096, 32); });
  CHECK_THAT(e, Catch::Contains(items[0].te_path));
  CHECK_THAT(e, Catch::Contains("t5_out"));
  e = ErrorMessageOf([&] { LoadFluxSample(items[0], 16, 48, 768); });
  CHECK_THAT(e, Catch::Contains("l_pooled"));

  std::remove((dir.str() + "/ok_flux_te.npz").c_str());
  e = ErrorMessageOf([&] { ScanFluxCache(dir.str()); });
  CHECK_THAT(e, Catch::Contains("ok_0032x0032_flux.npz"));
  CHECK_THAT(e, Catch::Contains("no text-encoder file ok_flux_te.npz"));
  TempDir empty("flux-cache-empty");
  CHECK(ErrorMessageOf([&] { ScanFluxCache(empty.str()); }).find("no latent cache") !=
        std::string::npos);
}

TEST_CASE("flux config: read from BFL's tensor names; other layouts refused by name",
          "[common][flux]") {
  TempDir dir("flux-config");
  const FluxConfig tiny = Tiny();
  const std::string path = WriteBfl(dir.str() + "/flux1.safetensors", tiny);
  CHECK(DetectFluxCheckpoint(path) == FluxCheckpointKind::kBflFile);
  const auto file = SafetensorsFile::Open(path);
  const FluxConfig c = FluxConfigFromHeader(file.header(), path);
  CHECK(c.hidden_size == 64);
  CHECK(c.num_heads == 4);
  CHECK(c.depth == 2);
  CHECK(c.depth_single == 3);
  CHECK(c.mlp_hidden == 256);
  CHECK(c.axes_dim == std::array<int64_t, 3>{4, 6, 6});
  CHECK(c.guidance_embed);
  FluxConfig schnell = tiny;  // FLUX.1-schnell has no guidance embedding
  schnell.guidance_embed = false;
  const std::string sp = WriteBfl(dir.str() + "/schnell.safetensors", schnell);
  CHECK_FALSE(FluxConfigFromHeader(SafetensorsFile::Open(sp).header(), sp).guidance_embed);

  const std::string extra = WriteBfl(dir.str() + "/extra.safetensors", tiny, [](auto& t) {
    t.push_back({"double_blocks.0.img_attn.lora.weight", DType::kF32, {2}, t[0].data});
  });
  std::string e =
      ErrorMessageOf([&] { FluxConfigFromHeader(SafetensorsFile::Open(extra).header(), extra); });
  CHECK_THAT(e, Catch::Contains("unexpected tensor `double_blocks.0.img_attn.lora.weight`"));
  const std::string missing = WriteBfl(dir.str() + "/missing.safetensors", tiny, [](auto& t) {
    t.erase(std::remove_if(
                t.begin(), t.end(),
                [](const TensorToWrite& x) { return x.name == "single_blocks.1.linear2.bias"; }),
            t.end());
  });
  e = ErrorMessageOf(
      [&] { FluxConfigFromHeader(SafetensorsFile::Open(missing).header(), missing); });
  CHECK_THAT(e, Catch::Contains("missing tensor `single_blocks.1.linear2.bias`"));

  const std::string diffusers = dir.str() + "/diffusion_pytorch_model.safetensors";
  static float z[64 * 64] = {};
  WriteSafetensors(diffusers, {{"x_embedder.weight", DType::kF32, {64, 64}, z}});
  CHECK_THAT(ErrorMessageOf([&] { DetectFluxCheckpoint(diffusers); }),
             Catch::Contains("diffusers transformer file"));
  CHECK_THAT(ErrorMessageOf([&] { DetectFluxCheckpoint(dir.str()); }),
             Catch::Contains("without a FluxTransformer2DModel config.json"));
}

TEST_CASE("flux names: kohya keys, diffusers parts, units of two block sizes", "[common][flux]") {
  const FluxConfig c = Tiny();
  CHECK(KohyaModuleName("double_blocks.0.img_attn.qkv") ==
        "lora_unet_double_blocks_0_img_attn_qkv");
  CHECK(KohyaModuleName("single_blocks.12.modulation.lin") ==
        "lora_unet_single_blocks_12_modulation_lin");
  const auto qkv = DiffusersParts("double_blocks.1.txt_attn.qkv", c);
  REQUIRE(qkv.size() == 3);
  CHECK(qkv[1].name == "transformer_blocks.1.attn.add_k_proj");
  CHECK(qkv[1].row_begin == 64);
  CHECK(qkv[1].row_end == 128);
  const auto l1 = DiffusersParts("single_blocks.2.linear1", c);
  REQUIRE(l1.size() == 4);
  CHECK(l1[3].name == "single_transformer_blocks.2.proj_mlp");
  CHECK(l1[3].row_end == 3 * 64 + 256);
  CHECK(DiffusersParts("double_blocks.0.img_mod.lin", c)[0].name ==
        "transformer_blocks.0.norm1.linear");
  CHECK(FluxTargets({"all"}, "t").size() == 13);
  CHECK_THAT(ErrorMessageOf([&] { FluxTargets({"img_attn.q"}, "job.toml: flux.targets"); }),
             Catch::Contains("`img_attn.q` is not a linear layer"));

  const auto units = FluxUnits(c, 2);  // 2 doubles, singles {0, 1} and {2}
  REQUIRE(units.size() == 4);
  CHECK(units[2].count == 2);
  CHECK(units[3].first == 2);
  CHECK(units[3].count == 1);
  // FLUX.1-dev in bf16: a double block 648 MiB, two single blocks 540 MiB.
  const FluxConfig dev;
  auto bytes = [&](const FluxUnit& u) {
    uint64_t n = 0;
    for (const auto& [name, shape] : FluxUnitShapes(dev, u)) {
      uint64_t k = 2;
      for (int64_t d : shape) k *= static_cast<uint64_t>(d);
      n += k;
    }
    return n;
  };
  CHECK(bytes({true, 0, 1}) / (1 << 20) == 648);
  CHECK(bytes({false, 0, 1}) / (1 << 20) == 270);
  CHECK(bytes({false, 0, 2}) / (1 << 20) == 540);
}
