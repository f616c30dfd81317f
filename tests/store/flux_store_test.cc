// A FLUX.1 checkpoint served by the store: one segment per streaming unit in the layout the
// worker packs itself (common/flux_layout.h), from BFL's file and a diffusers folder alike,
// published, verified and listed as FLUX.
#include <algorithm>
#include <fstream>
#include <sstream>
#include <string>

#include <catch2/catch.hpp>

#include "common/error.h"
#include "common/flux_layout.h"
#include "store/attach.h"
#include "store/commands.h"
#include "store/inspect.h"
#include "store/registry.h"
#include "store/server.h"
#include "tests/store/test_util.h"

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

std::unique_ptr<store::PublishedStore> Serve(const std::string& path, const std::string& name,
                                             QuantMethod quantize = QuantMethod::kNone) {
  store::ServeOptions o;
  o.model_dir = path;
  o.name = name;
  o.threads = 2;
  o.lock = false;
  o.quantize = quantize;
  return store::PublishedStore::Build(o);
}

}  // namespace

TEST_CASE("a FLUX.1 checkpoint is served per streaming unit, from BFL's file or diffusers'",
          "[store][flux]") {
  TempDir dir("flux-store");
  SynthFlux(dir.str() + "/bfl", "bfl");
  SynthFlux(dir.str() + "/diffusers", "diffusers");
  const std::string bfl_name = UniqueName("flux-bfl"), diffusers_name = UniqueName("flux-diff");
  auto bfl = Serve(dir.str() + "/bfl/flux1.safetensors", bfl_name);
  auto diffusers = Serve(dir.str() + "/diffusers/transformer", diffusers_name);

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

TEST_CASE("a FLUX.1 store refuses --quantize and a file that is not FLUX, by name",
          "[store][flux]") {
  TempDir dir("flux-store-refusals");
  SynthFlux(dir.str() + "/bfl", "bfl");
  const std::string name = UniqueName("flux-refused");
  CHECK_THROWS_WITH(Serve(dir.str() + "/bfl/flux1.safetensors", name, QuantMethod::kNf4),
                    Catch::Contains("--quantize nf4 is not available for FLUX.1"));
  { std::ofstream(dir.str() + "/notes.txt") << "not a checkpoint"; }
  CHECK_THROWS_WITH(Serve(dir.str() + "/notes.txt", name),
                    Catch::Contains("not a .safetensors file"));
  const std::vector<store::StoreListing> stores = store::ListStores();
  CHECK(std::none_of(stores.begin(), stores.end(),
                     [&](const store::StoreListing& s) { return s.name == name; }));
}
