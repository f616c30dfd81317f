#include <cstring>
#include <filesystem>
#include <set>

#include <catch2/catch.hpp>

#include "common/base/error.h"
#include "common/formats/safetensors.h"
#include "common/formats/tokenizer_id.h"
#include "store/convert.h"
#include "store/layout.h"
#include "test_util.h"

using namespace lorastream;
using namespace lorastream::store;
using namespace lorastream::testing;

namespace {
// The exact tensor names HF transformers expects for the config.
std::set<std::string> ExpectedNames(const ModelConfig& c) {
  std::set<std::string> names;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i)
    for (const auto& [rel, shape] : c.BlockTensorShapes())
      names.insert("model.layers." + std::to_string(i) + "." + rel);
  for (const auto& [name, shape] : c.RestTensorShapes()) names.insert(name);
  return names;
}
}  // namespace

TEST_CASE("synth writes exactly the tensors of each tiny preset", "[store]") {
  for (const std::string preset : {"tiny", "tiny-mistral", "tiny-qwen2", "tiny-qwen3"}) {
    INFO(preset);
    TempDir dir("store");
    Synth(preset, dir.str(), 7, "", /*shard_bytes=*/300000);
    Checkpoint cp = Checkpoint::Open(dir.str());
    std::set<std::string> names;
    for (const auto& ref : cp.AllTensors()) names.insert(ref.entry->name);
    CHECK(names == ExpectedNames(cp.config()));
    CHECK_NOTHROW(PlanPack(cp, PackOptions{}));
    CHECK(cp.config().model_type == LoadPreset(preset, PresetsDir()).config.model_type);
  }
  TempDir dir("store");
  Synth("tiny", dir.str());
  const ModelConfig c = Checkpoint::Open(dir.str()).config();
  CHECK(c.hidden_size == 64);
  CHECK(c.num_key_value_heads == 2);
  CHECK(c.max_position_embeddings == 256);
  CHECK(c.torch_dtype == "float32");
}

TEST_CASE("synth features: qwen2 bias and tying, qwen3 q/k norm and head_dim", "[store]") {
  const ModelConfig q2 = LoadPreset("tiny-qwen2", PresetsDir()).config;
  CHECK(q2.attention_bias);
  CHECK(q2.tie_word_embeddings);
  const ModelConfig q3 = LoadPreset("tiny-qwen3", PresetsDir()).config;
  CHECK(q3.qk_norm);
  CHECK(q3.head_dim == 32);
  CHECK(q3.head_dim * q3.num_attention_heads != q3.hidden_size);
}

TEST_CASE("full-size presets have the published shapes", "[store]") {
  const ModelConfig l = LoadPreset("llama-3-8b", PresetsDir()).config;
  CHECK(l.hidden_size == 4096);
  CHECK(l.intermediate_size == 14336);
  CHECK(l.num_hidden_layers == 32);
  CHECK(l.num_key_value_heads == 8);
  CHECK(l.vocab_size == 128256);
  CHECK(l.rope_scaling.type == "llama3");
  CHECK(l.rope_scaling.factor == 8.0);
  CHECK(l.rope_theta == 500000.0);
  CHECK(LoadPreset("llama-3-8b", PresetsDir()).dtype == DType::kBF16);
  const ModelConfig q = LoadPreset("qwen2.5-7b", PresetsDir()).config;
  CHECK((q.hidden_size == 3584 && q.intermediate_size == 18944 && q.num_hidden_layers == 28 &&
         q.num_key_value_heads == 4 && q.vocab_size == 152064 && q.attention_bias));
  const ModelConfig q3 = LoadPreset("qwen3-8b", PresetsDir()).config;
  CHECK((q3.hidden_size == 4096 && q3.intermediate_size == 12288 && q3.num_hidden_layers == 36 &&
         q3.head_dim == 128 && q3.vocab_size == 151936 && q3.qk_norm && !q3.tie_word_embeddings));
  CHECK_THROWS_WITH(LoadPreset("no-such-preset", PresetsDir()), Catch::Contains("does not exist"));
}

TEST_CASE("synth is deterministic per seed, scaled like HF init, and honours --layers/--dtype",
          "[store]") {
  TempDir a("store");
  TempDir b("store");
  TempDir c("store");
  TempDir d("store");
  Synth("tiny", a.str(), 42);
  Synth("tiny", b.str(), 42);
  Synth("tiny", c.str(), 43);
  Synth("tiny", d.str(), 42, "bf16", 4ull << 30, /*layers=*/2);
  SafetensorsFile fa = SafetensorsFile::Open(a.str() + "/model.safetensors");
  SafetensorsFile fb = SafetensorsFile::Open(b.str() + "/model.safetensors");
  SafetensorsFile fc = SafetensorsFile::Open(c.str() + "/model.safetensors");
  const auto* q = fa.Find("model.layers.1.self_attn.q_proj.weight");
  REQUIRE(q != nullptr);
  CHECK(std::memcmp(fa.Data(*q), fb.Data(*fb.Find(q->name)), q->nbytes()) == 0);
  CHECK(std::memcmp(fa.Data(*q), fc.Data(*fc.Find(q->name)), q->nbytes()) != 0);
  const float* w = reinterpret_cast<const float*>(fa.Data(*q));
  double sum = 0, sq = 0;
  for (uint64_t i = 0; i < q->numel(); ++i) {
    REQUIRE(w[i] == SynthValue(q->name, 2, 42, i));
    sum += w[i];
    sq += double(w[i]) * w[i];
  }
  const double mean = sum / q->numel(), stddev = std::sqrt(sq / q->numel() - mean * mean);
  CHECK(std::abs(mean) < 0.002);
  CHECK(stddev == Approx(0.02).epsilon(0.1));
  const float* norm = reinterpret_cast<const float*>(fa.Data(*fa.Find("model.norm.weight")));
  CHECK(norm[0] == Approx(1.0).margin(0.1));

  Checkpoint cd = Checkpoint::Open(d.str());
  CHECK(cd.config().num_hidden_layers == 2);
  CHECK(cd.config().torch_dtype == "bfloat16");
  const auto ref = cd.Get("model.layers.1.self_attn.q_proj.weight");
  CHECK(ref.entry->dtype == DType::kBF16);
  const uint16_t* h = reinterpret_cast<const uint16_t*>(ref.file->Data(*ref.entry));
  CHECK(h[5] == FloatToBF16(w[5]));
}

TEST_CASE("synth shards with an index when asked and replaces an earlier run", "[store]") {
  TempDir dir("store");
  SynthResult r = Synth("tiny", dir.str(), 1, "", /*shard_bytes=*/250000);
  CHECK(r.shards > 2);
  Checkpoint cp = Checkpoint::Open(dir.str());
  CHECK(cp.AllTensors().size() == 39);
  Synth("tiny", dir.str(), 1);  // single file now: the old index must be gone
  CHECK(Synth("tiny", dir.str(), 1).shards == 1);
  CHECK(Checkpoint::Open(dir.str()).AllTensors().size() == 39);
  CHECK_THROWS_WITH(Synth("tiny", dir.str(), 1, "f8"), Catch::Contains("must be f32, f16 or bf16"));
}

TEST_CASE("synth --tokenizer copies a tokenizer in and the store's plan records it",
          "[store][tokenizer]") {
  const std::string fixture =
      std::string(LORASTREAM_SOURCE_DIR) + "/tests/fixtures/tokenizers/llama3";  // 700 ids
  TempDir dir("store");
  SynthOptions o;
  o.preset = "tiny";  // vocab_size 512: grows to fit the tokenizer
  o.out_dir = dir.str();
  o.presets_dir = PresetsDir();
  o.threads = 2;
  o.tokenizer_dir = fixture;
  RunSynth(o);
  Checkpoint cp = Checkpoint::Open(dir.str());
  CHECK(cp.config().vocab_size == 700);
  const Manifest m = PlanPack(cp, PackOptions{}).manifest;
  CHECK(m.tokenizer.fingerprint == ModelTokenizerId(fixture)->fingerprint);
  CHECK(m.tokenizer.vocab_size == 700);

  TempDir plain("store");  // no tokenizer: the manifest records none
  Synth("tiny", plain.str());
  CHECK(PlanPack(Checkpoint::Open(plain.str()), PackOptions{})
            .manifest.tokenizer.fingerprint.empty());
  o.tokenizer_dir = plain.str();
  o.force = true;  // refused for the tokenizer folder, not for the non-empty --out
  CHECK_THROWS_WITH(RunSynth(o), Catch::Contains("has no tokenizer.json"));
}

TEST_CASE("synth --tokenizer NAME: the tokenizer bundled with lorastream (the README's llama3)",
          "[store][tokenizer]") {
  TempDir dir("store");
  SynthOptions o;
  o.preset = "tiny";
  o.out_dir = dir.str();
  o.presets_dir = PresetsDir();
  o.threads = 2;
  o.tokenizer_dir = "llama3";  // no such folder here: the bundled one (build tree: the fixture)
  RunSynth(o);
  CHECK(Checkpoint::Open(dir.str()).config().vocab_size == 700);
  CHECK(std::filesystem::exists(dir.path() / "tokenizer.json"));
  // Neither a folder nor a bundled name: says so, not "has no tokenizer.json".
  o.tokenizer_dir = "no-such-tokenizer";
  o.force = true;
  CHECK_THROWS_WITH(RunSynth(o), Catch::Contains("--tokenizer no-such-tokenizer does not exist") &&
                                     Catch::Contains("bundled with lorastream (llama3)"));
}
