// `lorastream-store dequantize`: the plain checkpoint holding what a compressed store expands
// to (what the parity harness gives transformers, and the quality report compares).
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include <catch2/catch.hpp>

#include "common/base/error.h"
#include "common/formats/safetensors.h"
#include "store/attach.h"
#include "store/convert.h"
#include "store/dequantize.h"
#include "store/layout.h"
#include "store/quantize.h"
#include "store/server.h"
#include "store/synth.h"
#include "test_util.h"

using namespace lorastream;
using namespace lorastream::store;
using namespace lorastream::testing;

namespace {

DequantizeResult Dequantize(const std::string& model, const std::string& out,
                            QuantMethod quantize) {
  DequantizeOptions o;
  o.model_dir = model;
  o.out_dir = out;
  o.quantize = quantize;
  o.threads = 2;
  return WriteDequantized(o);
}

std::string Bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

}  // namespace

TEST_CASE("dequantize: a plain checkpoint of the bf16 weights a compressed store expands to",
          "[store]") {
  TempDir dir("dequant");
  const std::string model = dir / "m";
  Synth("tiny-qwen2", model, 3, "bf16");  // q/k/v biases, tied embeddings
  std::ofstream(model + "/generation_config.json") << "{\"do_sample\": false}\n";
  const Checkpoint source = Checkpoint::Open(model);
  for (QuantMethod method : {QuantMethod::kFp8, QuantMethod::kNf4}) {
    INFO(QuantMethodName(method));
    const std::string out = dir / (std::string("deq-") + QuantMethodName(method));
    const DequantizeResult r = Dequantize(model, out, method);
    CHECK(r.format == StoreQuantFormat(method));
    CHECK(r.expanded_tensors == 7 * 3);

    // A checkpoint every reader takes as plain: same tensors, shapes and config.
    const Checkpoint cp = Checkpoint::Open(out);
    CHECK_NOTHROW(PlanPack(cp, PackOptions{}));
    CHECK(cp.AllTensors().size() == source.AllTensors().size());
    std::ifstream cfg(out + "/config.json");
    CHECK_FALSE(nlohmann::json::parse(cfg).contains("quantization_config"));
    CHECK(Bytes(out + "/generation_config.json") == "{\"do_sample\": false}\n");

    // Each projection weight is the store's expansion of it (served here the same way);
    // every other tensor is the source's bytes.
    const std::string name = UniqueName("deq");
    ServeOptions so;
    so.model_dir = model;
    so.name = name;
    so.threads = 2;
    so.quantize = method;
    const auto published = PublishedStore::Build(so);
    const AttachedStore store = AttachedStore::Attach(name);
    const Manifest& m = store.manifest();
    double signal = 0, noise = 0;
    for (const Checkpoint::Ref& ref : source.AllTensors()) {
      const SafetensorsEntry& src = *ref.entry;
      INFO(src.name);
      const Checkpoint::Ref got = cp.Get(src.name);
      REQUIRE(got.entry->shape == src.shape);
      REQUIRE(got.entry->dtype == DType::kBF16);
      const uint8_t* bytes = got.file->Data(*got.entry);
      const size_t dot = src.name.find('.', std::string("model.layers.").size());
      const bool projection =
          src.name.rfind("model.layers.", 0) == 0 && IsProjectionWeight(src.name.substr(dot + 1));
      if (!projection) {
        CHECK(std::memcmp(bytes, ref.file->Data(src), src.nbytes()) == 0);
        continue;
      }
      const int block = std::stoi(src.name.substr(13, dot - 13));
      const SegmentInfo& layout = m.blocks[block];
      const TensorSlice& w = *layout.Find(src.name.substr(dot + 1));
      const uint8_t* seg = store.block_data(block);
      const int64_t n = src.shape[0] * src.shape[1];
      std::vector<uint16_t> want(n);
      auto f32 = [&](const std::string& suffix) {
        return reinterpret_cast<const float*>(seg + layout.Find(w.name + suffix)->offset);
      };
      if (method == QuantMethod::kFp8) {
        ExpandFp8({seg + w.offset, f32("_scale_inv"), src.shape[0], src.shape[1], 128, 128}, 0, n,
                  want.data());
      } else {
        ExpandNf4(
            {seg + w.offset, seg + layout.Find(w.name + ".absmax")->offset, f32(".nested_absmax"),
             f32(".quant_map"), f32(".nested_quant_map"), *f32(".nested_offset"), n, 64, 256},
            0, n, want.data());
      }
      REQUIRE(std::memcmp(bytes, want.data(), 2 * n) == 0);
      std::vector<float> a(n), b(n);
      ConvertToFloat(DType::kBF16, ref.file->Data(src), a.data(), n);
      ConvertToFloat(DType::kBF16, bytes, b.data(), n);
      for (int64_t i = 0; i < n; ++i) {
        signal += double(a[i]) * a[i];
        noise += double(a[i] - b[i]) * (a[i] - b[i]);
      }
    }
    // Close to the source: fp8 keeps ~30 dB, nf4 ~20 dB on these Gaussian weights.
    CHECK(10 * std::log10(signal / noise) > (method == QuantMethod::kFp8 ? 25 : 15));
  }
}

TEST_CASE("dequantize: a pre-quantised folder as it is; refusals", "[store]") {
  TempDir dir("dequant-pre");
  const std::string model = dir / "m";
  Synth("tiny", model, 5, "bf16");
  // synth's pre-quantised folders are quantised as `serve --quantize` would: the same weights.
  for (const auto& [format, method] :
       {std::pair{"fp8", QuantMethod::kFp8}, std::pair{"bnb-nf4", QuantMethod::kNf4}}) {
    INFO(format);
    const std::string pre = dir / (std::string("pre-") + format);
    std::filesystem::copy(model, pre);
    WritePrequantized(pre, format);
    const std::string a = dir / (std::string("a-") + format);
    const std::string b = dir / (std::string("b-") + format);
    CHECK(Dequantize(pre, a, QuantMethod::kNone).format == StoreQuantFormat(method));
    Dequantize(model, b, method);
    CHECK(Bytes(a + "/model.safetensors") == Bytes(b + "/model.safetensors"));
  }
  auto error = [&](const std::string& model_dir, const std::string& out, QuantMethod q) {
    try {
      Dequantize(model_dir, out, q);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  CHECK_THAT(error(model, dir / "plain", QuantMethod::kNone),
             Catch::Contains("holds no compressed weights") && Catch::Contains("--quantize"));
  CHECK_THAT(error(model, dir / "a-fp8", QuantMethod::kFp8),
             Catch::Contains("already holds files"));
  CHECK_THAT(error(dir / "missing", dir / "c", QuantMethod::kFp8), Catch::Contains("missing"));
}
