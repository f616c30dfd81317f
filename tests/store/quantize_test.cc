// The compressed formats in the store: the arithmetic against plain reference
// dequantisations written here from the formats' definitions, `serve --quantize` end to end
// (layout, checksums over the compressed bytes, manifest round trip), and the refusals of a
// manifest whose scales or packed weight do not fit.
#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>

#include <nlohmann/json.hpp>

#include <catch2/catch.hpp>

#include "common/base/error.h"
#include "common/formats/manifest.h"
#include "common/formats/safetensors.h"
#include "store/attach.h"
#include "store/commands.h"
#include "store/convert.h"
#include "store/quantize.h"
#include "store/registry.h"
#include "store/server.h"
#include "store/synth.h"
#include "test_util.h"

using namespace lorastream;
using namespace lorastream::store;
using namespace lorastream::testing;

namespace {

// e4m3fn from its definition: (-1)^s * 2^(e-7) * (1 + m/8), subnormal 2^-6 * m/8.
float ReferenceE4M3(uint8_t b) {
  const int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
  const double v = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1 + m / 8.0, e - 7);
  return static_cast<float>(s ? -v : v);
}

// bf16 by rounding the f32 bits to nearest even (finite values only here).
uint16_t ReferenceBF16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t lower = u & 0xffff, upper = u >> 16;
  if (lower > 0x8000 || (lower == 0x8000 && (upper & 1))) return static_cast<uint16_t>(upper + 1);
  return static_cast<uint16_t>(upper);
}

std::vector<float> RandomWeights(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 0.02f);
  std::vector<float> w(n);
  for (float& v : w) v = dist(rng);
  w[n / 3] = 0.3f;  // an outlier: its tile's scale is larger than the others'
  return w;
}

std::unique_ptr<PublishedStore> Serve(const std::string& dir, const std::string& name,
                                      QuantMethod quantize) {
  ServeOptions o;
  o.model_dir = dir;
  o.name = name;
  o.threads = 2;
  o.quantize = quantize;
  return PublishedStore::Build(o);
}

std::string ServeError(const std::string& dir, QuantMethod quantize = QuantMethod::kNone) {
  const std::string name = UniqueName("q-bad");
  try {
    Serve(dir, name, quantize);
  } catch (const Error& e) {
    CHECK(ShmObjectsOf(name).empty());  // refused before anything was published
    return e.what();
  }
  return "(accepted)";
}

// Rewrites the single-file checkpoint in `dir`, replacing tensor `name` by `edit`'s result.
void RewriteTensor(const std::string& dir, const std::string& name,
                   const std::function<void(TensorToWrite&, std::vector<uint8_t>&)>& edit) {
  SafetensorsFile f = SafetensorsFile::Open(dir + "/model.safetensors");
  std::vector<TensorToWrite> tensors;
  std::vector<uint8_t> bytes;
  for (const SafetensorsEntry& e : f.tensors()) {
    tensors.push_back({e.name, e.dtype, e.shape, f.Data(e)});
    if (e.name == name) {
      bytes.assign(f.Data(e), f.Data(e) + e.nbytes());
      edit(tensors.back(), bytes);
      tensors.back().data = bytes.data();
    }
  }
  WriteSafetensors(dir + "/model.safetensors", tensors);
}

void EditConfig(const std::string& dir, const std::function<void(nlohmann::json&)>& edit) {
  std::ifstream in(dir + "/config.json");
  nlohmann::json j = nlohmann::json::parse(in);
  edit(j);
  std::ofstream(dir + "/config.json") << j.dump();
}

void SynthPrequantized(const std::string& dir, const std::string& format) {
  SynthOptions o;
  o.preset = "tiny-qwen2";
  o.out_dir = dir;
  o.presets_dir = PresetsDir();
  o.seed = 3;
  o.dtype = "bf16";
  o.threads = 2;
  o.prequantized = format;
  RunSynth(o);
}

}  // namespace

TEST_CASE("e4m3: every code decodes as its definition and encodes back to itself", "[store]") {
  for (int b = 0; b < 256; ++b) {
    if ((b & 0x7f) == 0x7f) {
      CHECK(std::isnan(E4M3ToFloat(static_cast<uint8_t>(b))));
      continue;
    }
    INFO(b);
    const float v = ReferenceE4M3(static_cast<uint8_t>(b));
    CHECK(E4M3ToFloat(static_cast<uint8_t>(b)) == v);
    if (b != 0x80) CHECK(FloatToE4M3(v) == b);  // -0 encodes as itself too
  }
  CHECK(FloatToE4M3(1000.0f) == 0x7e);      // saturates at 448
  CHECK(FloatToE4M3(-1000.0f) == 0xfe);     // and -448
  CHECK(FloatToE4M3(1.0625f) == 0x38);      // a tie between 1 and 1.125: to the even mantissa
  CHECK(FloatToE4M3(1.1875f) == 0x3a);      // between 1.125 and 1.25: to 1.25 (even)
  CHECK(FloatToE4M3(0.00097656f) == 0x00);  // a quarter of the smallest subnormal: zero
}

TEST_CASE("e4m3: a float encodes as the nearest code, a tie to the even one", "[store]") {
  // The definition, by search: the smallest distance; a tie to the even code; 448 at most.
  auto reference = [](float x) {
    const double a = std::min(std::fabs(static_cast<double>(x)), 448.0);
    int best = 0;
    for (int b = 1; b < 0x7f; ++b) {
      const double d = std::fabs(a - ReferenceE4M3(static_cast<uint8_t>(b)));
      const double d_best = std::fabs(a - ReferenceE4M3(static_cast<uint8_t>(best)));
      if (d < d_best || (d == d_best && b % 2 == 0)) best = b;
    }
    return static_cast<uint8_t>((std::signbit(x) ? 0x80 : 0) | best);
  };
  std::vector<float> values;
  for (uint32_t u = 0; u <= 0x43f00000u; u += 65537) {  // 0 to 480, spread over the bits
    float f;
    std::memcpy(&f, &u, sizeof f);
    values.push_back(f);
    values.push_back(-f);
  }
  // Every midpoint between two neighbouring codes, and the floats on either side of it.
  for (int b = 0; b + 1 < 0x7f; ++b) {
    const float mid = static_cast<float>(
        (ReferenceE4M3(static_cast<uint8_t>(b)) + ReferenceE4M3(static_cast<uint8_t>(b + 1))) / 2);
    for (float v : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1000.0f)})
      values.push_back(v);
  }
  for (float v : values) {
    INFO(v);
    REQUIRE(FloatToE4M3(v) == reference(v));
  }
}

TEST_CASE("fp8: expansion equals a plain reference dequantisation bit for bit", "[store]") {
  const int64_t rows = 200, cols = 300, br = 128, bc = 128;  // partial tiles on both edges
  const std::vector<float> w = RandomWeights(rows * cols, 7);
  std::vector<uint8_t> q(rows * cols);
  const int64_t tr = 2, tc = 3;
  std::vector<float> scale(tr * tc);
  for (int64_t r = 0; r < rows; r += br)
    QuantizeFp8Band(w.data() + r * cols, std::min(br, rows - r), cols, bc, q.data() + r * cols,
                    scale.data() + r / br * tc);
  Fp8Weight fw{q.data(), scale.data(), rows, cols, br, bc};
  std::vector<uint16_t> out(rows * cols);
  ExpandFp8(fw, 0, rows * cols, out.data());
  std::vector<uint16_t> part(450);
  ExpandFp8(fw, 12250, 12700, part.data());  // across tiles and rows: the same as the whole
  CHECK(std::memcmp(part.data(), out.data() + 12250, 900) == 0);
  double err = 0, norm = 0;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const float s = scale[(r / br) * tc + c / bc];
      const uint16_t ref = ReferenceBF16(ReferenceE4M3(q[r * cols + c]) * s);
      REQUIRE(out[r * cols + c] == ref);
      const double d = BF16ToFloat(ref) - w[r * cols + c];
      err += d * d;
      norm += double(w[r * cols + c]) * w[r * cols + c];
    }
  }
  // The tile with the outlier has a coarser scale; the weight as a whole keeps > 25 dB SQNR.
  CHECK(10 * std::log10(norm / err) > 25);
  CHECK(scale[0] > scale[5]);  // element n/3 = row 100 lies in the first tile row's tiles
}

TEST_CASE("nf4: each weight takes the nearest code, the lower one on a tie", "[store]") {
  // Random weights, plus in one block of amax 1 every code and every midpoint between two
  // neighbouring codes (a tie), and values just beside them.
  std::vector<float> w = RandomWeights(64 * 200, 5);
  std::vector<float> edges = {1.0f, -1.0f, 0.0f};
  for (size_t k = 0; k + 1 < kNf4Code.size(); ++k) {
    const float mid = (kNf4Code[k] + kNf4Code[k + 1]) / 2;
    for (float v : {kNf4Code[k], mid, std::nextafter(mid, -2.0f), std::nextafter(mid, 2.0f)})
      edges.push_back(v);
  }
  REQUIRE(edges.size() <= 64);
  edges.resize(64, 0.5f);
  w.insert(w.end(), edges.begin(), edges.end());
  const int64_t n = static_cast<int64_t>(w.size());
  std::vector<uint8_t> packed(n / 2);
  std::vector<float> absmax(n / 64);
  QuantizeNf4(w.data(), n, 64, packed.data(), absmax.data());
  // The reference: the code at the smallest distance, the first (lower) one on a tie.
  auto nearest = [](float x) {
    int best = 0;
    for (int k = 1; k < 16; ++k)
      if (std::fabs(x - kNf4Code[k]) < std::fabs(x - kNf4Code[best])) best = k;
    return best;
  };
  for (int64_t i = 0; i < n; ++i) {
    INFO("element " << i << " = " << w[i]);
    const float amax = absmax[i / 64];
    const float x = w[i] * (amax > 0 ? 1.0f / amax : 0.0f);
    const int code = i % 2 == 0 ? packed[i / 2] >> 4 : packed[i / 2] & 15;
    REQUIRE(code == nearest(x));
  }
}

TEST_CASE("nf4: expansion equals a plain reference dequantisation bit for bit", "[store]") {
  const int64_t n = 64 * 600 + 64;  // 601 blocks: three nested groups, the last partial
  const std::vector<float> w = RandomWeights(n, 11);
  std::vector<uint8_t> packed(n / 2), absmax_q(601);
  std::vector<float> absmax(601), nested(3);
  float offset = 0;
  QuantizeNf4(w.data(), n, 64, packed.data(), absmax.data());
  DoubleQuantizeAbsmax(absmax.data(), 601, 256, absmax_q.data(), nested.data(), &offset);
  double mean = 0;
  for (float a : absmax) mean += a;
  CHECK(offset == Approx(mean / 601).epsilon(1e-6));
  const std::array<float, 256>& map = DynamicMap8Bit();
  CHECK(std::is_sorted(map.begin(), map.end()));
  CHECK(map[255] == 1.0f);  // bitsandbytes' signed map ends at 1 but starts above -1
  CHECK(map[0] == Approx(-0.99297).margin(1e-5));
  Nf4Weight nw{packed.data(),
               absmax_q.data(),
               nested.data(),
               kNf4Code.data(),
               map.data(),
               offset,
               n,
               64,
               256};
  std::vector<uint16_t> out(n);
  ExpandNf4(nw, 0, n, out.data());
  std::vector<uint16_t> part(77);
  ExpandNf4(nw, 1001, 1078, part.data());  // an odd start: the low nibble first
  CHECK(std::memcmp(part.data(), out.data() + 1001, 77 * 2) == 0);
  double err = 0, norm = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int code = i % 2 == 0 ? packed[i / 2] >> 4 : packed[i / 2] & 15;
    const float scaled = map[absmax_q[i / 64]] * nested[i / 64 / 256];
    const float a = scaled + offset;
    const uint16_t ref = ReferenceBF16(kNf4Code[code] * a);
    REQUIRE(out[i] == ref);
    const double d = BF16ToFloat(ref) - w[i];
    err += d * d;
    norm += double(w[i]) * w[i];
  }
  CHECK(10 * std::log10(norm / err) > 15);  // 4 bits: ~19-20 dB on Gaussian weights
}

TEST_CASE("serve --quantize: compressed blocks, checksums over them, the manifest says so",
          "[store]") {
  TempDir dir("quant");
  Synth("tiny-qwen2", dir.str(), 3, "bf16");  // q/k/v biases stay unchanged
  const std::string plain_name = UniqueName("q-plain");
  auto plain = Serve(dir.str(), plain_name, QuantMethod::kNone);
  const uint64_t plain_block = plain->manifest().blocks[0].nbytes;
  CHECK(ManifestToJson(plain->manifest()).find("\"quant\"") == std::string::npos);
  CHECK_FALSE(plain->manifest().quant().compressed());
  Checkpoint cp = Checkpoint::Open(dir.str());
  for (QuantMethod method : {QuantMethod::kFp8, QuantMethod::kNf4}) {
    INFO(QuantMethodName(method));
    const std::string name = UniqueName("q");
    auto published = Serve(dir.str(), name, method);
    const Manifest& m = published->manifest();
    CHECK(m.quant() == StoreQuantFormat(method));
    CHECK(m.fingerprint != plain->manifest().fingerprint);
    // Tiny blocks: nf4's per-weight code tables and alignment weigh more than its weights.
    CHECK(m.blocks[0].nbytes < plain_block * (method == QuantMethod::kFp8 ? 0.6 : 0.65));
    CHECK(m.rest.nbytes == plain->manifest().rest.nbytes);  // embedding and head unchanged
    AttachedStore store = AttachedStore::Attach(name, m.fingerprint);
    CHECK_NOTHROW(VerifyChecksums(store, 2));
    // ls and verify say the format.
    std::ostringstream ls, verify;
    RunLs(ls);
    RunVerify(name, 2, verify);
    const std::string format = "blocks " + DescribeQuant(StoreQuantFormat(method));
    CHECK_THAT(ls.str(), Catch::Contains(name + ": published") && Catch::Contains(format));
    CHECK_THAT(verify.str(), Catch::Contains(format) && Catch::Contains("every checksum matches"));
    // The manifest's round trip keeps every format.
    const Manifest back = ManifestFromJson(ManifestToJson(m), "test");
    for (size_t k = 0; k < m.blocks[1].tensors.size(); ++k)
      CHECK(back.blocks[1].tensors[k].quant == m.blocks[1].tensors[k].quant);
    // Norms and biases are the checkpoint's bytes; every projection weight is compressed.
    int compressed = 0;
    for (const TensorSlice& t : m.blocks[1].tensors) {
      if (t.quant.compressed()) {
        ++compressed;
        CHECK(IsProjectionWeight(t.name));
      } else if (t.name.find("norm") != std::string::npos ||
                 t.name.find("bias") != std::string::npos) {
        const auto ref = cp.Get("model.layers.1." + t.name);
        CHECK(std::memcmp(store.tensor_data(1, t.name), ref.file->Data(*ref.entry), t.nbytes) == 0);
      }
    }
    CHECK(compressed == 7);
    // The fp8 store's q_proj expands to within a tile's rounding of the checkpoint's weight.
    if (method == QuantMethod::kFp8) {
      const TensorSlice* q = m.blocks[1].Find("self_attn.q_proj.weight");
      const auto ref = cp.Get("model.layers.1.self_attn.q_proj.weight");
      const auto* src = reinterpret_cast<const uint16_t*>(ref.file->Data(*ref.entry));
      Fp8Weight fw{store.tensor_data(1, q->name),
                   reinterpret_cast<const float*>(store.tensor_data(1, q->name + "_scale_inv")),
                   q->shape[0],
                   q->shape[1],
                   128,
                   128};
      std::vector<uint16_t> out(q->shape[0] * q->shape[1]);
      ExpandFp8(fw, 0, static_cast<int64_t>(out.size()), out.data());
      for (size_t i = 0; i < out.size(); ++i) {
        const float want = BF16ToFloat(src[i]);
        REQUIRE(std::fabs(BF16ToFloat(out[i]) - want) <= std::fabs(want) / 8 + 1e-3f);
      }
    }
  }
}

TEST_CASE("a manifest whose scales or packed weight do not fit is refused naming the tensor",
          "[store]") {
  ModelConfig c;
  c.model_type = "llama";
  c.hidden_size = 64;
  c.intermediate_size = 96;
  c.num_attention_heads = c.num_key_value_heads = 4;
  c.head_dim = 16;
  c.vocab_size = 32;
  c.max_position_embeddings = 64;
  const std::vector<std::pair<std::string, std::vector<int64_t>>> shapes = {
      {"input_layernorm.weight", {64}},
      {"self_attn.q_proj.weight", {64, 64}},
      {"mlp.up_proj.weight", {96, 64}}};
  auto problem = [&](QuantMethod method, const std::function<void(SegmentInfo&)>& edit) {
    SegmentInfo s = LayoutSegment(shapes, "/x", DType::kBF16, 256, StoreQuantFormat(method));
    REQUIRE(QuantLayoutProblem(s).empty());
    edit(s);
    return QuantLayoutProblem(s);
  };
  auto slice = [](SegmentInfo& s, const std::string& name) -> TensorSlice& {
    for (TensorSlice& t : s.tensors)
      if (t.name == name) return t;
    FAIL("no " << name);
    throw;
  };
  CHECK_THAT(problem(QuantMethod::kFp8,
                     [&](SegmentInfo& s) {
                       slice(s, "mlp.up_proj.weight_scale_inv").shape = {2, 1};
                     }),
             Catch::Contains("`mlp.up_proj.weight_scale_inv` is F32 [2, 1]") &&
                 Catch::Contains("needs F32 [1, 1]"));
  CHECK_THAT(problem(QuantMethod::kNf4,
                     [&](SegmentInfo& s) { slice(s, "self_attn.q_proj.weight").nbytes -= 1; }),
             Catch::Contains("`self_attn.q_proj.weight` holds 2047 bytes") &&
                 Catch::Contains("truncated"));
  CHECK_THAT(
      problem(QuantMethod::kNf4,
              [&](SegmentInfo& s) {
                s.tensors.erase(s.tensors.begin() + 3);  // q_proj.weight.nested_absmax
              }),
      Catch::Contains("`self_attn.q_proj.weight.nested_absmax`") && Catch::Contains("is missing"));
  CHECK_THAT(problem(QuantMethod::kFp8,
                     [&](SegmentInfo& s) {
                       slice(s, "input_layernorm.weight").quant =
                           StoreQuantFormat(QuantMethod::kFp8);
                     }),
             Catch::Contains("`input_layernorm.weight` is stored fp8"));
  // Through the manifest reader: the same message, with the block named.
  Manifest m;
  m.config = c;
  m.config.num_hidden_layers = 1;
  m.blocks.push_back(
      LayoutSegment(shapes, "/b0", DType::kBF16, 256, StoreQuantFormat(QuantMethod::kFp8)));
  m.blocks[0].tensors[2].shape = {1, 2};  // q_proj's scales
  m.rest = LayoutSegment({}, "/rest", DType::kBF16, 256);
  CHECK_THROWS_WITH(ManifestFromJson(ManifestToJson(m), "manifest.json"),
                    Catch::Contains("block 0: tensor `self_attn.q_proj.weight_scale_inv`"));
}

TEST_CASE("pre-quantised fp8 and bnb-nf4 checkpoints are served as they are", "[store]") {
  TempDir plain("q-src");
  Synth("tiny-qwen2", plain.str(), 3, "bf16");
  for (const std::string format : {"fp8", "bnb-nf4"}) {
    INFO(format);
    const QuantMethod method = format == "fp8" ? QuantMethod::kFp8 : QuantMethod::kNf4;
    TempDir dir("q-pre");
    SynthPrequantized(dir.str(), format);
    const Checkpoint cp = Checkpoint::Open(dir.str());
    CHECK(cp.config().checkpoint_quant.method == method);
    const std::string name = UniqueName("q-pre");
    auto pre = Serve(dir.str(), name, QuantMethod::kNone);
    CHECK(pre->manifest().quant() == StoreQuantFormat(method));
    // Its bytes are the checkpoint's: the same as quantising the plain weights here.
    auto here = Serve(plain.str(), UniqueName("q-here"), method);
    CHECK(pre->manifest().fingerprint == here->manifest().fingerprint);
    AttachedStore store = AttachedStore::Attach(name);
    CHECK_NOTHROW(VerifyChecksums(store, 2));
    const auto w = cp.Get("model.layers.1.mlp.up_proj.weight");
    CHECK(std::memcmp(store.tensor_data(1, "mlp.up_proj.weight"), w.file->Data(*w.entry),
                      w.entry->nbytes()) == 0);
    CHECK_THAT(ServeError(dir.str(), method),
               Catch::Contains("already quantised") && Catch::Contains("without --quantize"));
  }
}

TEST_CASE(
    "pre-quantised checkpoints with bad scales, a truncated weight or an unknown "
    "quant_method are refused naming the tensor",
    "[store]") {
  TempDir fp8("q-fp8");
  SynthPrequantized(fp8.str(), "fp8");
  RewriteTensor(fp8.str(), "model.layers.0.mlp.up_proj.weight_scale_inv",
                [](TensorToWrite& t, std::vector<uint8_t>& b) {
                  t.shape = {1, 1};
                  b.resize(4);
                });
  CHECK_THAT(ServeError(fp8.str()),
             Catch::Contains("tensor `model.layers.0.mlp.up_proj.weight_scale_inv` is F32 [1, 1]"));

  TempDir nf4("q-nf4");
  SynthPrequantized(nf4.str(), "bnb-nf4");
  RewriteTensor(nf4.str(), "model.layers.1.mlp.down_proj.weight",
                [](TensorToWrite& t, std::vector<uint8_t>& b) {
                  b.resize(b.size() - 64);
                  t.shape = {static_cast<int64_t>(b.size()), 1};
                });
  CHECK_THAT(ServeError(nf4.str()),
             Catch::Contains("tensor `model.layers.1.mlp.down_proj.weight`") &&
                 Catch::Contains("(truncated?)"));

  TempDir other("q-other");
  Synth("tiny", other.str(), 3, "bf16");
  EditConfig(other.str(), [](nlohmann::json& j) {
    j["quantization_config"] = {{"quant_method", "gptq"}, {"bits", 4}};
  });
  CHECK_THAT(ServeError(other.str()),
             Catch::Contains("quantization_config.quant_method `gptq` is not supported"));
  EditConfig(other.str(), [](nlohmann::json& j) {
    j["quantization_config"] = {{"quant_method", "bitsandbytes"}, {"load_in_8bit", true}};
  });
  CHECK_THAT(ServeError(other.str()), Catch::Contains("load_in_4bit is not true"));
}

TEST_CASE("a pre-quantised nf4 checkpoint whose nested_offset is absurd is refused naming the key",
          "[store][hostile]") {
  // 1e300: a float cannot hold it; the store published it and the job failed later as "loss
  // is -nan (lower optim.lr ...)".
  for (const std::string value : {"1e300", "-1e300", "5e7"}) {
    INFO(value);
    TempDir nf4("q-nf4-offset");
    SynthPrequantized(nf4.str(), "bnb-nf4");
    const std::string tensor = "model.layers.0.mlp.up_proj.weight.quant_state.bitsandbytes__nf4";
    RewriteTensor(nf4.str(), tensor, [&](TensorToWrite& t, std::vector<uint8_t>& b) {
      nlohmann::json j = nlohmann::json::parse(b.begin(), b.end());
      j["nested_offset"] = std::stod(value);
      const std::string text = j.dump();
      b.assign(text.begin(), text.end());
      t.shape = {static_cast<int64_t>(b.size())};
    });
    const std::string e = ServeError(nf4.str());
    CHECK_THAT(e, Catch::Contains("tensor `" + tensor + "`"));
    CHECK_THAT(e, Catch::Contains("`nested_offset` is"));
    CHECK_THAT(e, Catch::Contains("not a finite number of at most 1000000"));
  }
}
