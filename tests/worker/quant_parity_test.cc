// Parity with a compressed base (fp8, nf4). `lorastream-worker parity --store` on a compressed
// store computes what the plain path computes on `lorastream-store dequantize`'s checkpoint of
// it (bit for bit on the CPU), and, where tools/parity/quant_fixtures.py's fixtures are present
// (tests/fixtures/quant, or $LORASTREAM_QUANT_FIXTURES), what transformers + peft compute on
// the dequantised weights (f32, 1e-4 relative), with pre-quantised checkpoints written from
// the formats' specifications expanding to the fixture's dequantisation bit for bit.
#include "torch_catch.h"  // first: see there

#include <cstdlib>
#include <filesystem>
#include <utility>

#include <ATen/ATen.h>

#include "common/formats/safetensors.h"
#include "parity_test_util.h"
#include "store/dequantize.h"
#include "worker/model/base_weights.h"
#include "worker/model/lora.h"
#include "worker_test_util.h"

using namespace lorastream;
using namespace lorastream::worker;

namespace {

// `lorastream-worker parity` with `source` ("--model DIR" or "--store NAME") into `out`.
SafetensorsFile Parity(const std::string& source, const std::string& tokens,
                       const std::string& adapter, const std::string& out) {
  const std::string cmd = std::string(LORASTREAM_BIN_DIR) + "/lorastream-worker parity " + source +
                          " --tokens " + tokens + " --adapter " + adapter + " --out " + out +
                          " > " + out + ".log 2>&1";
  const int status = std::system(cmd.c_str());
  INFO(testing::ReadFile(out + ".log"));
  REQUIRE(status == 0);
  return SafetensorsFile::Open(out + "/parity.safetensors");
}

at::Tensor Get(const SafetensorsFile& f, const std::string& name) {
  const SafetensorsEntry* e = f.Find(name);
  INFO(f.path() << ": " << name);
  REQUIRE(e != nullptr);
  const at::ScalarType type = ScalarTypeOf(e->dtype, name);
  return at::from_blob(const_cast<uint8_t*>(f.Data(*e)), e->shape, type).clone();
}

double RelErr(const at::Tensor& got, const at::Tensor& want) {
  return ((got.to(at::kDouble) - want.to(at::kDouble)).abs().max() /
          want.to(at::kDouble).abs().max().clamp_min(1e-30))
      .item<double>();
}

std::vector<std::string> GradNames(const SafetensorsFile& f) {
  std::vector<std::string> names;
  for (const SafetensorsEntry& e : f.tensors())
    if (e.name.rfind("grad.", 0) == 0) names.push_back(e.name);
  return names;
}

}  // namespace

TEST_CASE("parity on a compressed store equals parity on its dequantised checkpoint", "[worker]") {
  testing::TempDir dir("qparity");
  const std::string model = testing::MakeCheckpoint(dir / "m", "tiny-qwen2");  // f32, biases
  BaseWeights plain = BaseWeights::FromCheckpoint(model);
  const ModelConfig& c = plain.config();
  testing::WriteParityInputs(dir.str(), c, model);
  const SafetensorsFile unquantized =
      Parity("--model " + model, dir / "tokens.safetensors", dir / "adapter", dir / "plain");

  // The blocks compressed; then the (tied) LM head and embedding table as well.
  for (auto [method, head] : {std::pair{QuantMethod::kFp8, false},
                              {QuantMethod::kNf4, false},
                              {QuantMethod::kFp8, true},
                              {QuantMethod::kNf4, true}}) {
    const std::string tag = std::string(QuantMethodName(method)) + (head ? "-head" : "");
    INFO(tag);
    const auto published = testing::ServeForTest(model, method, "qparity", head);
    const SafetensorsFile ours = Parity("--store " + published->manifest().store_name,
                                        dir / "tokens.safetensors", dir / "adapter", dir / tag);
    store::DequantizeOptions d;
    d.model_dir = model;
    d.out_dir = dir / ("deq-" + tag);
    d.quantize = method;
    d.quantize_head = head;
    d.threads = 2;
    store::WriteDequantized(d);
    const SafetensorsFile ref = Parity("--model " + d.out_dir, dir / "tokens.safetensors",
                                       dir / "adapter", dir / ("ref-" + tag));
    CHECK(at::equal(Get(ours, "logits"), Get(ref, "logits")));
    CHECK(at::equal(Get(ours, "loss"), Get(ref, "loss")));
    const auto grads = GradNames(ref);
    CHECK(grads.size() == 3 * 7 * 2);
    CHECK(GradNames(ours) == grads);
    for (const std::string& g : grads) {
      INFO(g);
      CHECK(at::equal(Get(ours, g), Get(ref, g)));
    }
    // The compression shows: the logits differ from the unquantised model's, more for nf4.
    const double drift = RelErr(Get(ours, "logits"), Get(unquantized, "logits"));
    CHECK(drift > 1e-4);
    CHECK(drift < 0.5);
  }
}

TEST_CASE("parity on a compressed store against transformers + peft (fixtures)",
          "[worker][parity]") {
  const char* env = std::getenv("LORASTREAM_QUANT_FIXTURES");
  const std::string fixtures =
      env && *env ? env : std::string(LORASTREAM_SOURCE_DIR) + "/tests/fixtures/quant";
  // Each case: the checkpoint served, how, and its reference.
  struct Case {
    std::string name, model;
    QuantMethod quantize;
  };
  const Case cases[] = {{"fp8", "model", QuantMethod::kFp8},
                        {"nf4", "model", QuantMethod::kNf4},
                        {"fp8-pre", "model-fp8", QuantMethod::kNone},
                        {"bnb-nf4-pre", "model-bnb-nf4", QuantMethod::kNone}};
  testing::TempDir dir("qparity-fix");
  int checked = 0;
  for (const Case& k : cases) {
    const std::string reference = fixtures + "/reference-" + k.name + ".safetensors";
    const std::string model = fixtures + "/" + k.model;
    if (!std::filesystem::exists(reference) || !std::filesystem::exists(model)) {
      WARN("skipped " << k.name << ": " << reference << " or " << model
                      << " is absent; make them with tools/parity/quant_fixtures.py (on a "
                         "machine with torch, transformers and peft)");
      continue;
    }
    INFO(k.name);
    const auto published = testing::ServeForTest(model, k.quantize, "qparity");
    const SafetensorsFile want = SafetensorsFile::Open(reference);
    const SafetensorsFile got =
        Parity("--store " + published->manifest().store_name, fixtures + "/tokens.safetensors",
               fixtures + "/adapter", dir / k.name);
    CHECK(RelErr(Get(got, "logits"), Get(want, "logits")) <= 1e-4);
    CHECK(RelErr(Get(got, "loss"), Get(want, "loss")) <= 1e-4);
    const auto grads = GradNames(want);
    CHECK(grads.size() == GradNames(got).size());
    for (const std::string& g : grads) {
      INFO(g);
      CHECK(RelErr(Get(got, g), Get(want, g)) <= 1e-4);
    }
    // A pre-quantised checkpoint written from the format's specification expands to the
    // fixture's dequantisation of it (block 0's projections), bit for bit.
    if (k.quantize == QuantMethod::kNone) {
      const BaseWeights base = BaseWeights::FromStore(published->manifest().store_name);
      const SegmentInfo& layout = base.manifest()->blocks[0];
      int weights = 0;
      for (const TensorSlice& t : layout.tensors) {
        if (!t.quant.compressed()) continue;
        INFO(t.name);
        const at::Tensor ours = *BlockWeightField(base.block(0), t.name);
        const at::Tensor ref = Get(want, "dequantized.model.layers.0." + t.name);
        REQUIRE(ref.scalar_type() == at::kBFloat16);
        CHECK(at::equal(ours.to(at::kBFloat16), ref));
        ++weights;
      }
      CHECK(weights == 7);
    }
    ++checked;
  }
  if (checked == 0) WARN("no quantised parity fixture in " << fixtures << ": nothing compared");
}
