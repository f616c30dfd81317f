// A Qwen-Image checkpoint served by the store: one segment per transformer block in the layout
// the worker packs itself (common/formats/qwen_image_layout.h), from ComfyUI's single file (bare or
// prefixed names) and a diffusers folder alike, published, verified, listed and inspected as
// Qwen-Image; with --quantize fp8|nf4, every block linear's weight stored compressed (the
// bytes a plain reference quantisation of the whole weight gives); ComfyUI's fp8 file (its
// block linears in e4m3, no scales) served as it is.
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "common/formats/qwen_image_layout.h"
#include "common/formats/safetensors.h"
#include "store/attach.h"
#include "store/commands.h"
#include "store/inspect.h"
#include "store/registry.h"
#include "store/server.h"
#include "store/synth_qwen_image.h"
#include "tests/store/test_util.h"
#include "tests/support/flux_checkpoint.h"

using namespace lorastream;
using namespace lorastream::testing;

namespace {

// lorastream-synth --preset qwen-image-tiny in `format` (comfyui, comfyui-prefixed,
// diffusers), f32; returns the path a store serves (the file, or the model folder).
std::string SynthQwenImage(const std::string& out, const std::string& format) {
  store::SynthOptions o;
  o.preset = "qwen-image-tiny";
  o.out_dir = out;
  o.presets_dir = PresetsDir();
  o.seed = 5;
  o.dtype = "f32";
  o.qwen_image_format = format;
  o.force = true;
  store::RunSynth(o);
  return format == "diffusers" ? out : out + "/" + store::kSynthQwenImageFile;
}

// Every segment of store `a` holds the bytes of the same segment of store `b`.
void CheckSameSegments(const std::string& a, const std::string& b) {
  const store::AttachedStore x = store::AttachedStore::Attach(a);
  const store::AttachedStore y = store::AttachedStore::Attach(b);
  REQUIRE(x.num_blocks() == y.num_blocks());
  for (int u = 0; u < x.num_blocks(); ++u) {
    REQUIRE(x.block_size(u) == y.block_size(u));
    CHECK(std::memcmp(x.block_data(u), y.block_data(u), x.block_size(u)) == 0);
  }
  REQUIRE(x.manifest().rest.nbytes == y.manifest().rest.nbytes);
  CHECK(std::memcmp(x.rest_data(), y.rest_data(), x.manifest().rest.nbytes) == 0);
}

}  // namespace

TEST_CASE(
    "a Qwen-Image checkpoint is served one block per segment, from ComfyUI's file or "
    "diffusers', the same bytes",
    "[store][qwen_image]") {
  TempDir dir("qwen-image-store");
  const std::string single = SynthQwenImage(dir.str() + "/comfyui", "comfyui");
  const std::string prefixed = SynthQwenImage(dir.str() + "/prefixed", "comfyui-prefixed");
  const std::string folder = SynthQwenImage(dir.str() + "/diffusers", "diffusers");
  const std::string name = UniqueName("qi"), prefixed_name = UniqueName("qi-prefixed"),
                    folder_name = UniqueName("qi-diffusers");
  auto published = ServeInProcess(single, name);
  auto from_prefixed = ServeInProcess(prefixed, prefixed_name);
  auto from_folder = ServeInProcess(folder + "/transformer", folder_name);

  const Manifest& m = published->manifest();
  REQUIRE(m.is_qwen_image());
  CHECK(m.family() == "Qwen-Image");
  CHECK(m.qwen_image.num_layers == 2);
  CHECK(m.dtype == DType::kF32);
  // The worker's layout exactly: QwenImageManifest's segments, tensors under their full names.
  const Manifest layout = QwenImageManifest(m.qwen_image, DType::kF32, m.alignment);
  REQUIRE(m.blocks.size() == 2);
  for (size_t u = 0; u < m.blocks.size(); ++u) {
    CHECK(m.blocks[u].nbytes == layout.blocks[u].nbytes);
    REQUIRE(m.blocks[u].tensors.size() == layout.blocks[u].tensors.size());
    for (size_t t = 0; t < m.blocks[u].tensors.size(); ++t) {
      CHECK(m.blocks[u].tensors[t].name == layout.blocks[u].tensors[t].name);
      CHECK(m.blocks[u].tensors[t].offset == layout.blocks[u].tensors[t].offset);
    }
  }
  CHECK(m.blocks[1].Find("transformer_blocks.1.attn.to_q.weight") != nullptr);
  CHECK(m.rest.Find("img_in.weight") != nullptr);
  // Every form holds the same bytes in every segment, and so has the same fingerprint.
  CHECK(from_prefixed->manifest().fingerprint == m.fingerprint);
  CHECK(from_folder->manifest().fingerprint == m.fingerprint);
  CheckSameSegments(name, folder_name);
  CheckSameSegments(name, prefixed_name);

  // Attached by name, its manifest read back as Qwen-Image; every checksum holds; ls, verify
  // and inspect say Qwen-Image.
  store::AttachedStore attached = store::AttachedStore::Attach(folder_name, m.fingerprint);
  CHECK(attached.manifest().is_qwen_image());
  CHECK(attached.manifest().qwen_image.hidden() == m.qwen_image.hidden());
  CHECK(attached.manifest().qwen_image.axes_dim == m.qwen_image.axes_dim);
  store::VerifyChecksums(attached, 2);
  std::ostringstream verify, ls, inspect_file, inspect_folder;
  store::RunVerify(name, 2, verify);
  CHECK_THAT(verify.str(), Catch::Contains("Qwen-Image, 2 blocks + rest") &&
                               Catch::Contains("every checksum matches"));
  store::RunLs(ls);
  CHECK_THAT(ls.str(),
             Catch::Contains(name + ": ") && Catch::Contains("qwen_image, 2 blocks, F32"));
  store::RunInspect(single, inspect_file);
  CHECK_THAT(inspect_file.str(), Catch::Contains("Qwen-Image (single file): 2 blocks") &&
                                     Catch::Contains("every tensor matches it"));
  store::RunInspect(folder, inspect_folder);
  CHECK_THAT(inspect_folder.str(), Catch::Contains("Qwen-Image (diffusers folder): 2 blocks"));

  // The manifest round-trips; one whose layout was altered is refused naming the block.
  const Manifest back = ManifestFromJson(ManifestToJson(m), "test");
  CHECK(back.is_qwen_image());
  CHECK(back.qwen_image.joint_attention_dim == m.qwen_image.joint_attention_dim);
  CHECK(back.blocks.size() == m.blocks.size());
  Manifest moved = m;
  moved.blocks[1].tensors[0].offset += m.alignment;
  moved.blocks[1].nbytes += m.alignment;
  CHECK_THROWS_WITH(ManifestFromJson(ManifestToJson(moved), "moved.json"),
                    Catch::Contains("block 1 is not the Qwen-Image layout of its shape"));
}

TEST_CASE("serve --quantize fp8|nf4 of a Qwen-Image checkpoint: its block linears compressed",
          "[store][qwen_image]") {
  TempDir dir("qwen-image-store-quant");
  const std::string single = SynthQwenImage(dir.str() + "/comfyui", "comfyui");
  const std::string folder = SynthQwenImage(dir.str() + "/diffusers", "diffusers");
  const SafetensorsFile source = SafetensorsFile::Open(single);
  const std::string plain_name = UniqueName("qi-plain");
  auto plain = ServeInProcess(single, plain_name);
  const Manifest& pm = plain->manifest();
  store::AttachedStore plain_store = store::AttachedStore::Attach(plain_name, pm.fingerprint);
  for (QuantMethod method : {QuantMethod::kFp8, QuantMethod::kNf4}) {
    INFO(QuantMethodName(method));
    const QuantInfo format = StoreQuantFormat(method);
    const std::string name = UniqueName("qi-q"), folder_name = UniqueName("qi-qd");
    auto published = ServeInProcess(single, name, method);
    const Manifest& m = published->manifest();
    REQUIRE(m.is_qwen_image());
    CHECK(m.quant() == format);
    CHECK(m.dtype == DType::kF32);  // norms, biases and the rest keep the checkpoint's dtype
    const Manifest layout = QwenImageManifest(m.qwen_image, DType::kF32, m.alignment, format);
    REQUIRE(m.blocks.size() == layout.blocks.size());
    for (size_t u = 0; u < m.blocks.size(); ++u)
      CHECK(m.blocks[u].nbytes == layout.blocks[u].nbytes);
    auto from_folder = ServeInProcess(folder, folder_name, method);
    CHECK(from_folder->manifest().fingerprint == m.fingerprint);
    CheckSameSegments(name, folder_name);

    store::AttachedStore store = store::AttachedStore::Attach(name, m.fingerprint);
    store::VerifyChecksums(store, 2);
    // A block's 14 linears, the modulations too.
    CHECK(CheckCompressedBlocks(m, store, source, pm, plain_store, IsQwenImageBlockLinearWeight) ==
          std::vector<int>{14, 14});
    REQUIRE(m.rest.nbytes == pm.rest.nbytes);
    CHECK(std::memcmp(store.rest_data(), plain_store.rest_data(), m.rest.nbytes) == 0);
    std::ostringstream ls;
    store::RunLs(ls);
    CHECK_THAT(ls.str(),
               Catch::Contains("qwen_image, 2 blocks, F32, blocks " + DescribeQuant(format)));
    CHECK(ManifestFromJson(ManifestToJson(m), "test").quant() == format);
  }
}

TEST_CASE("ComfyUI's fp8 Qwen-Image file is served as it is: fp8 with scales of 1",
          "[store][qwen_image]") {
  TempDir dir("qwen-image-store-fp8-file");
  const std::string single = SynthQwenImage(dir.str() + "/comfyui", "comfyui");
  const std::string path = dir.str() + "/qwen_image_fp8_e4m3fn.safetensors";
  WriteFp8Checkpoint(single, path, IsQwenImageBlockLinearWeight);
  const SafetensorsFile source = SafetensorsFile::Open(path);
  const std::string name = UniqueName("qi-fp8-file");
  auto published = ServeInProcess(path, name);
  const Manifest& m = published->manifest();
  REQUIRE(m.is_qwen_image());
  CHECK(m.quant() == StoreQuantFormat(QuantMethod::kFp8));
  CHECK(m.dtype == DType::kF32);
  store::AttachedStore store = store::AttachedStore::Attach(name, m.fingerprint);
  store::VerifyChecksums(store, 2);
  CHECK(CheckFp8AsFile(m, store, source) == 2 * 14);
  std::ostringstream inspect;
  store::RunInspect(path, inspect);
  CHECK_THAT(inspect.str(),
             Catch::Contains("Qwen-Image (single file)") && Catch::Contains("pre-quantised fp8"));
  // nf4 of fp8 weights, and a file mixing fp8 and f32 linear weights, are refused by name.
  CHECK_THROWS_WITH(ServeInProcess(path, UniqueName("qi-fp8-nf4"), QuantMethod::kNf4),
                    Catch::Contains("are fp8 (F8_E4M3) already"));
  const std::string mixed = dir.str() + "/qwen_image_mixed.safetensors";
  WriteFp8Checkpoint(single, mixed, IsQwenImageBlockLinearWeight,
                     "transformer_blocks.1.img_mlp.net.2.weight");
  CHECK_THROWS_WITH(ServeInProcess(mixed, UniqueName("qi-fp8-mixed")),
                    Catch::Contains("tensor `transformer_blocks.1.img_mlp.net.2.weight` is F32") &&
                        Catch::Contains("F8_E4M3"));
  // Only the block linears may be fp8: a tensor outside them in fp8 is refused by name.
  const std::string outside = dir.str() + "/qwen_image_img_in_fp8.safetensors";
  WriteFp8Checkpoint(single, outside, [](const std::string& tensor) {
    return IsQwenImageBlockLinearWeight(tensor) || tensor == "img_in.weight";
  });
  CHECK_THROWS_WITH(ServeInProcess(outside, UniqueName("qi-fp8-outside")),
                    Catch::Contains("tensor `img_in.weight` is F8_E4M3"));
}
