// A FLUX.1 checkpoint served by the store: one segment per streaming unit in the layout the
// worker packs itself (common/formats/flux_layout.h), from BFL's file and a diffusers folder alike,
// published, verified and listed as FLUX; with --quantize fp8|nf4, every block linear's weight
// stored compressed (the bytes a plain reference quantisation of the whole weight gives) and
// everything else as the plain store holds it.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <catch2/catch.hpp>

#include "common/base/error.h"
#include "common/formats/flux_layout.h"
#include "common/formats/safetensors.h"
#include "common/posix/subprocess.h"
#include "store/attach.h"
#include "store/commands.h"
#include "store/convert.h"
#include "store/inspect.h"
#include "store/quantize.h"
#include "store/registry.h"
#include "store/server.h"
#include "tests/store/test_util.h"
#include "tests/support/flux_checkpoint.h"

using namespace lorastream;
using namespace lorastream::testing;

namespace {

store::SynthResult SynthFlux(const std::string& out, const std::string& format) {
  store::SynthOptions o;
  o.preset = "flux-tiny";
  o.out_dir = out;
  o.presets_dir = PresetsDir();
  o.seed = 3;
  o.dtype = "f32";
  o.flux_format = format;
  o.shard_bytes = format == "diffusers" ? 400000 : 4ull << 30;
  o.force = true;
  return store::RunSynth(o);
}

}  // namespace

TEST_CASE("a FLUX.1 checkpoint is served per streaming unit, from BFL's file or diffusers'",
          "[store][flux]") {
  TempDir dir("flux-store");
  SynthFlux(dir.str() + "/bfl", "bfl");
  SynthFlux(dir.str() + "/diffusers", "diffusers");
  const std::string bfl_name = UniqueName("flux-bfl"), diffusers_name = UniqueName("flux-diff");
  auto bfl = ServeInProcess(dir.str() + "/bfl/flux1.safetensors", bfl_name);
  auto diffusers = ServeInProcess(dir.str() + "/diffusers/transformer", diffusers_name);

  const Manifest& m = bfl->manifest();
  REQUIRE(m.is_flux());
  CHECK(m.flux.depth == 2);
  CHECK(m.flux.depth_single == 4);
  CHECK(m.flux_singles_per_unit == kFluxDefaultSinglesPerUnit);
  CHECK(m.dtype == DType::kF32);
  // The worker's layout exactly: FluxManifest's segments, tensors under their BFL names.
  const Manifest layout = FluxManifest(m.flux, 2, DType::kF32, m.alignment);
  REQUIRE(m.blocks.size() == 2 + 2);  // two double units, two units of two single blocks
  for (size_t u = 0; u < m.blocks.size(); ++u) {
    CHECK(m.blocks[u].nbytes == layout.blocks[u].nbytes);
    REQUIRE(m.blocks[u].tensors.size() == layout.blocks[u].tensors.size());
    for (size_t t = 0; t < m.blocks[u].tensors.size(); ++t) {
      CHECK(m.blocks[u].tensors[t].name == layout.blocks[u].tensors[t].name);
      CHECK(m.blocks[u].tensors[t].offset == layout.blocks[u].tensors[t].offset);
    }
  }
  CHECK(m.blocks[2].Find("single_blocks.1.linear1.weight") != nullptr);
  CHECK(m.rest.Find("final_layer.adaLN_modulation.1.weight") != nullptr);
  // The same weights in either layout: the same bytes, so the same fingerprint.
  CHECK(diffusers->manifest().fingerprint == m.fingerprint);

  // Attached read-only by name, its manifest read back as FLUX; every checksum holds.
  store::AttachedStore attached = store::AttachedStore::Attach(bfl_name, m.fingerprint);
  CHECK(attached.manifest().is_flux());
  CHECK(attached.manifest().flux_singles_per_unit == 2);
  CHECK(attached.num_blocks() == 4);
  store::VerifyChecksums(attached, 2);
  std::ostringstream verify, ls;
  store::RunVerify(diffusers_name, 2, verify);
  CHECK_THAT(verify.str(), Catch::Contains("FLUX.1, 4 units + rest"));
  CHECK_THAT(verify.str(), Catch::Contains("every checksum matches"));
  store::RunLs(ls);
  CHECK_THAT(ls.str(), Catch::Contains(bfl_name + ": "));
  CHECK_THAT(ls.str(), Catch::Contains("flux, 4 units, F32"));
  // A small store's size in the unit it is read in ("1.95 MiB"), never "0.002 GiB".
  const std::string listing = ls.str();
  const size_t line_at = listing.find(bfl_name + ": ");
  REQUIRE(line_at != std::string::npos);
  const std::string line = listing.substr(line_at, listing.find('\n', line_at) - line_at);
  CHECK_THAT(line, Catch::Matches(".*shm objects, [0-9.]+ (KiB|MiB).*"));

  // The manifest round-trips; a FLUX manifest whose layout was altered is refused.
  const Manifest back = ManifestFromJson(ManifestToJson(m), "test");
  CHECK(back.flux.hidden_size == m.flux.hidden_size);
  CHECK(back.blocks.size() == m.blocks.size());
  Manifest moved = m;
  moved.blocks[1].tensors[0].offset += m.alignment;
  moved.blocks[1].nbytes += m.alignment;
  CHECK_THROWS_WITH(ManifestFromJson(ManifestToJson(moved), "moved.json"),
                    Catch::Contains("unit 1 is not the FLUX layout of its shape"));

  std::ostringstream inspect;
  store::RunInspect(dir.str() + "/diffusers", inspect);
  CHECK_THAT(inspect.str(), Catch::Contains("FLUX.1 (diffusers folder): 2 double + 4 single"));
}

TEST_CASE("a FLUX.1 store refuses a file that is not FLUX, by name", "[store][flux]") {
  TempDir dir("flux-store-refusals");
  const std::string name = UniqueName("flux-refused");
  { std::ofstream(dir.str() + "/notes.txt") << "not a checkpoint"; }
  CHECK_THROWS_WITH(ServeInProcess(dir.str() + "/notes.txt", name),
                    Catch::Contains("not a .safetensors file"));
  const std::vector<store::StoreListing> stores = store::ListStores();
  CHECK(std::none_of(stores.begin(), stores.end(),
                     [&](const store::StoreListing& s) { return s.name == name; }));
}

TEST_CASE("serve --quantize fp8|nf4 of a FLUX.1 checkpoint: its block linears compressed",
          "[store][flux]") {
  TempDir dir("flux-store-quant");
  SynthFlux(dir.str() + "/bfl", "bfl");
  SynthFlux(dir.str() + "/diffusers", "diffusers");
  const std::string bfl_path = dir.str() + "/bfl/flux1.safetensors";
  const SafetensorsFile source = SafetensorsFile::Open(bfl_path);
  const std::string plain_name = UniqueName("flux-plain");
  auto plain = ServeInProcess(bfl_path, plain_name);
  const Manifest& pm = plain->manifest();
  store::AttachedStore plain_store = store::AttachedStore::Attach(plain_name, pm.fingerprint);
  for (QuantMethod method : {QuantMethod::kFp8, QuantMethod::kNf4}) {
    INFO(QuantMethodName(method));
    const QuantInfo format = StoreQuantFormat(method);
    const std::string name = UniqueName("flux-q"), diffusers_name = UniqueName("flux-qd");
    auto published = ServeInProcess(bfl_path, name, method);
    const Manifest& m = published->manifest();
    REQUIRE(m.is_flux());
    CHECK(m.quant() == format);
    CHECK(m.dtype == DType::kF32);  // norms, biases and the rest keep the checkpoint's dtype
    CHECK(m.fingerprint != pm.fingerprint);
    // The worker's layout with the format: FluxManifest's segments, compressed.
    const Manifest layout = FluxManifest(m.flux, 2, DType::kF32, m.alignment, format);
    REQUIRE(m.blocks.size() == layout.blocks.size());
    for (size_t u = 0; u < m.blocks.size(); ++u)
      CHECK(m.blocks[u].nbytes == layout.blocks[u].nbytes);
    // Quantised from the whole weight: a diffusers folder's runs of rows (its qkv as to_q,
    // to_k, to_v) give the very same bytes.
    auto diffusers = ServeInProcess(dir.str() + "/diffusers/transformer", diffusers_name, method);
    CHECK(diffusers->manifest().fingerprint == m.fingerprint);

    store::AttachedStore store = store::AttachedStore::Attach(name, m.fingerprint);
    store::VerifyChecksums(store, 2);
    // A double block's 10 linears, a unit of two single blocks' 3 each.
    CHECK(CheckCompressedBlocks(m, store, source, pm, plain_store, IsFluxBlockLinearWeight) ==
          std::vector<int>{10, 10, 6, 6});
    // Everything outside the blocks as the plain store has it.
    REQUIRE(m.rest.nbytes == pm.rest.nbytes);
    CHECK(std::memcmp(store.rest_data(), plain_store.rest_data(), m.rest.nbytes) == 0);

    // ls and verify say the format; the manifest round-trips, its layout checked with it.
    std::ostringstream ls, verify;
    store::RunLs(ls);
    store::RunVerify(name, 2, verify);
    const std::string described = "blocks " + DescribeQuant(format);
    CHECK_THAT(ls.str(), Catch::Contains("flux, 4 units, F32, " + described));
    CHECK_THAT(verify.str(), Catch::Contains("FLUX.1, 4 units + rest") &&
                                 Catch::Contains(described) &&
                                 Catch::Contains("every checksum matches"));
    const Manifest back = ManifestFromJson(ManifestToJson(m), "test");
    CHECK(back.quant() == format);
    Manifest plain_unit = m;  // a unit laid out plain in a compressed store is refused
    plain_unit.blocks[3] = pm.blocks[3];
    CHECK_THROWS_WITH(ManifestFromJson(ManifestToJson(plain_unit), "mixed.json"),
                      Catch::Contains("unit 3 is not the FLUX layout of its shape"));
    Manifest bias = m;  // only a linear's weight may be compressed: the tensor is named
    for (TensorSlice& t : bias.blocks[0].tensors)
      if (t.name == "double_blocks.0.img_mod.lin.bias") t.quant = format;
    CHECK_THROWS_WITH(ManifestFromJson(ManifestToJson(bias), "bias.json"),
                      Catch::Contains("bias.json") &&
                          Catch::Contains("tensor `double_blocks.0.img_mod.lin.bias`"));
  }
}

TEST_CASE("an fp8 FLUX.1 checkpoint is served as it is: fp8 with scales of 1", "[store][flux]") {
  TempDir dir("flux-store-fp8-file");
  SynthFlux(dir.str() + "/bfl", "bfl");
  const std::string path = dir.str() + "/flux1-fp8.safetensors";
  WriteFp8FluxCheckpoint(dir.str() + "/bfl/flux1.safetensors", path);
  const SafetensorsFile source = SafetensorsFile::Open(path);
  const std::string name = UniqueName("flux-fp8-file");
  auto published = ServeInProcess(path, name);
  const Manifest& m = published->manifest();
  CHECK(m.quant() == StoreQuantFormat(QuantMethod::kFp8));
  CHECK(m.dtype == DType::kF32);  // the other tensors' dtype
  store::AttachedStore store = store::AttachedStore::Attach(name, m.fingerprint);
  store::VerifyChecksums(store, 2);
  CHECK(CheckFp8AsFile(m, store, source) == 2 * 10 + 4 * 3);
  // --quantize fp8 holds the same; nf4 of fp8 weights, and a checkpoint mixing fp8 and f32
  // linear weights, are refused by name.
  auto again = ServeInProcess(path, UniqueName("flux-fp8-file"), QuantMethod::kFp8);
  CHECK(again->manifest().fingerprint == m.fingerprint);
  CHECK_THROWS_WITH(ServeInProcess(path, UniqueName("flux-fp8-nf4"), QuantMethod::kNf4),
                    Catch::Contains("are fp8 (F8_E4M3) already"));
  const std::string mixed = dir.str() + "/flux1-mixed.safetensors";
  WriteFp8FluxCheckpoint(dir.str() + "/bfl/flux1.safetensors", mixed,
                         "single_blocks.1.linear2.weight");
  CHECK_THROWS_WITH(ServeInProcess(mixed, UniqueName("flux-fp8-mixed")),
                    Catch::Contains("tensor `single_blocks.1.linear2.weight` is F32") &&
                        Catch::Contains("F8_E4M3"));
}

TEST_CASE(
    "a FLUX.1 checkpoint naming a block index past any model is refused by inspect, by "
    "name",
    "[store][flux][hostile]") {
  TempDir dir("flux-store-index");
  SynthFlux(dir.str() + "/bfl", "bfl");
  const std::string path = dir.str() + "/bfl/flux1.safetensors";
  // double_blocks.100000000.*: `inspect` and `train` ran out of memory sizing 10^8 blocks.
  const std::string bad = "double_blocks.100000000.img_mod.lin.bias";
  {
    SafetensorsFile f = SafetensorsFile::Open(path);
    std::vector<TensorToWrite> tensors;
    std::vector<std::vector<uint8_t>> bytes;
    bytes.reserve(f.tensors().size());
    for (const SafetensorsEntry& e : f.tensors()) {
      bytes.emplace_back(f.Data(e), f.Data(e) + e.nbytes());
      tensors.push_back({e.name == "double_blocks.1.img_mod.lin.bias" ? bad : e.name, e.dtype,
                         e.shape, bytes.back().data()});
    }
    WriteSafetensors(path + ".tmp", tensors, f.header().metadata);
  }
  std::filesystem::rename(path + ".tmp", path);
  std::ostringstream out;
  try {
    store::RunInspect(path, out);
    FAIL("inspected");
  } catch (const Error& e) {
    CHECK_THAT(e.what(), Catch::Contains("tensor `" + bad + "`: block index 100000000"));
  }
  int code = 0;
  const std::string err = dir.str() + "/inspect.err";
  RunAndCapture({Bin("lorastream-store"), "inspect", path}, &code, 120, err);
  CHECK(code == 4);  // corrupt input
  std::ifstream in(err);
  std::stringstream text;
  text << in.rdbuf();
  CHECK_THAT(text.str(), Catch::Contains("tensor `" + bad + "`"));
}
