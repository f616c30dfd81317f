// `serve --quantize fp8|nf4 --quantize-head` (and --quantize-embedding): the LM head (a tied
// model's one table) compressed in the rest segment in the blocks' format, checksums and
// fingerprint over the compressed bytes, ls/verify/dequantize knowing it, and the refusals:
// the flag without --quantize, a rest-segment layout whose head scales do not fit, a
// compressed tensor that may not be.
#include <cstring>
#include <sstream>

#include <catch2/catch.hpp>

#include "common/base/error.h"
#include "common/formats/manifest.h"
#include "common/formats/safetensors.h"
#include "store/attach.h"
#include "store/commands.h"
#include "store/dequantize.h"
#include "store/registry.h"
#include "store/server.h"
#include "test_util.h"

using namespace lorastream;
using namespace lorastream::store;
using namespace lorastream::testing;

namespace {

std::unique_ptr<PublishedStore> Serve(const std::string& dir, const std::string& name,
                                      QuantMethod quantize, bool head, bool embedding = false) {
  ServeOptions o;
  o.model_dir = dir;
  o.name = name;
  o.threads = 2;
  o.quantize = quantize;
  o.quantize_head = head;
  o.quantize_embedding = embedding;
  return PublishedStore::Build(o);
}

}  // namespace

TEST_CASE("serve --quantize-head: the LM head compressed in the rest, checked and listed",
          "[store]") {
  for (const std::string preset : {"tiny", "tiny-qwen2"}) {  // untied, tied
    TempDir dir("qhead");
    Synth(preset, dir.str(), 3, "bf16");
    const Checkpoint cp = Checkpoint::Open(dir.str());
    const bool tied = cp.config().tie_word_embeddings;
    const std::string head_name = tied ? "model.embed_tokens.weight" : "lm_head.weight";
    for (QuantMethod method : {QuantMethod::kFp8, QuantMethod::kNf4}) {
      INFO(preset << " " << QuantMethodName(method));
      auto blocks_only = Serve(dir.str(), UniqueName("qh-b"), method, false);
      const std::string name = UniqueName("qh");
      auto published = Serve(dir.str(), name, method, true);
      const Manifest& m = published->manifest();
      // The head in the blocks' format, its scales after it; everything else unchanged.
      const TensorSlice* head = m.head();
      REQUIRE(head != nullptr);
      CHECK(head->name == head_name);
      CHECK(head->quant == StoreQuantFormat(method));
      CHECK(head->shape == std::vector<int64_t>{cp.config().vocab_size, cp.config().hidden_size});
      for (const QuantAuxTensor& aux : QuantAuxTensors(head->name, head->shape, head->quant)) {
        const TensorSlice* s = m.rest.Find(aux.name);
        REQUIRE(s != nullptr);
        CHECK(s->shape == aux.shape);
        CHECK(s->offset > head->offset);
      }
      int compressed = 0;
      for (const TensorSlice& t : m.rest.tensors) compressed += t.quant.compressed() ? 1 : 0;
      CHECK(compressed == 1);
      CHECK(m.rest.nbytes < blocks_only->manifest().rest.nbytes);
      CHECK(m.blocks[0].nbytes == blocks_only->manifest().blocks[0].nbytes);
      // The checksums cover the compressed bytes; the fingerprint tells the stores apart.
      CHECK(m.fingerprint != blocks_only->manifest().fingerprint);
      AttachedStore store = AttachedStore::Attach(name, m.fingerprint);
      CHECK_NOTHROW(VerifyChecksums(store, 2));
      const Manifest back = ManifestFromJson(ManifestToJson(m), "test");
      REQUIRE(back.head() != nullptr);
      CHECK(back.head()->quant == head->quant);
      // ls and verify say so.
      const std::string says =
          std::string(tied ? "LM head and embedding " : "LM head ") + QuantMethodName(method);
      CHECK_THAT(m.DescribeCompression(), Catch::Contains(says));
      std::ostringstream ls, verify;
      RunLs(ls);
      RunVerify(name, 2, verify);
      CHECK_THAT(ls.str(), Catch::Contains(says));
      CHECK_THAT(verify.str(), Catch::Contains(says) && Catch::Contains("every checksum matches"));
      // The dequantised checkpoint holds the head expanded: that store's expansion, as bf16.
      TempDir out("qhead-out");
      DequantizeOptions d;
      d.model_dir = dir.str();
      d.out_dir = out.str() + "/m";
      d.quantize = method;
      d.quantize_head = true;
      d.threads = 2;
      const DequantizeResult r = WriteDequantized(d);
      CHECK(r.expanded_tensors == 7 * cp.config().num_hidden_layers + 1);
      const SafetensorsFile f = SafetensorsFile::Open(d.out_dir + "/model.safetensors");
      const SafetensorsEntry* e = f.Find(head_name);
      REQUIRE(e != nullptr);
      CHECK(e->dtype == DType::kBF16);
      std::vector<uint16_t> want(static_cast<size_t>(head->shape[0] * head->shape[1]));
      ExpandElements(store.rest_data(), m.rest, *head, 0, static_cast<int64_t>(want.size()),
                     want.data());
      CHECK(std::memcmp(f.Data(*e), want.data(), want.size() * 2) == 0);
    }
  }
}

TEST_CASE("serve --quantize-embedding: an untied table compressed beside the head", "[store]") {
  TempDir dir("qemb");
  Synth("tiny", dir.str(), 3, "bf16");
  auto published = Serve(dir.str(), UniqueName("qe"), QuantMethod::kNf4, true, true);
  const Manifest& m = published->manifest();
  CHECK(m.rest.Find("lm_head.weight")->quant.compressed());
  CHECK(m.rest.Find("model.embed_tokens.weight")->quant.compressed());
  CHECK_FALSE(m.rest.Find("model.norm.weight")->quant.compressed());
  CHECK_THAT(m.DescribeCompression(), Catch::Contains("LM head nf4, embedding nf4") ||
                                          Catch::Contains("embedding nf4, LM head nf4"));
  CHECK_NOTHROW(VerifyChecksums(AttachedStore::Attach(m.store_name), 2));
  // A tied model's one table is the embedding too: either flag compresses it.
  TempDir tied("qemb-tied");
  Synth("tiny-qwen2", tied.str(), 3, "bf16");
  auto embedding_only = Serve(tied.str(), UniqueName("qe-t"), QuantMethod::kFp8, false, true);
  CHECK(embedding_only->manifest().head()->quant == StoreQuantFormat(QuantMethod::kFp8));
  CHECK(embedding_only->manifest().head()->name == "model.embed_tokens.weight");
}

TEST_CASE("--quantize-head needs --quantize; a head layout that does not fit is refused",
          "[store]") {
  TempDir dir("qhead-bad");
  Synth("tiny", dir.str(), 3, "bf16");
  for (bool embedding : {false, true}) {
    const std::string name = UniqueName("qh-bad");
    try {
      Serve(dir.str(), name, QuantMethod::kNone, !embedding, embedding);
      FAIL("accepted");
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::kInvalidArgument);
      CHECK_THAT(e.what(),
                 Catch::Contains(embedding ? "--quantize-embedding" : "--quantize-head") &&
                     Catch::Contains("--quantize fp8|nf4"));
    }
    CHECK(ShmObjectsOf(name).empty());
  }
  // A manifest whose head scales have the wrong shape: the reader names the tensor.
  const std::vector<std::pair<std::string, std::vector<int64_t>>> rest = {
      {"model.embed_tokens.weight", {512, 64}},
      {"model.norm.weight", {64}},
      {"lm_head.weight", {512, 64}}};
  for (QuantMethod method : {QuantMethod::kFp8, QuantMethod::kNf4}) {
    SegmentInfo s =
        LayoutSegment(rest, "/r", DType::kBF16, 256, StoreQuantFormat(method), {"lm_head.weight"});
    CHECK(QuantLayoutProblem(s, /*rest_segment=*/true).empty());
    // The same names are not a block's projections.
    CHECK_THAT(QuantLayoutProblem(s), Catch::Contains("tensor `lm_head.weight` is stored"));
    const std::string scale =
        method == QuantMethod::kFp8 ? "lm_head.weight_scale_inv" : "lm_head.weight.absmax";
    for (TensorSlice& t : s.tensors)
      if (t.name == scale) t.shape = {1, 1};
    CHECK_THAT(QuantLayoutProblem(s, true),
               Catch::Contains("tensor `" + scale + "`") && Catch::Contains("needs"));
  }
  // Only the head and the embedding may be compressed in the rest.
  const SegmentInfo norm =
      LayoutSegment({{"model.norm.weight", {64, 64}}}, "/r", DType::kBF16, 256,
                    StoreQuantFormat(QuantMethod::kFp8), {"model.norm.weight"});  // 2-D: the name
  CHECK_THAT(QuantLayoutProblem(norm, true),
             Catch::Contains("tensor `model.norm.weight` is stored fp8") &&
                 Catch::Contains("only the LM head and the embedding table"));
  // Through the manifest reader, with the segment named.
  Manifest m;
  m.config.model_type = "llama";
  m.config.num_hidden_layers = 1;
  m.config.hidden_size = 64;
  m.config.intermediate_size = 96;
  m.config.num_attention_heads = m.config.num_key_value_heads = 4;
  m.config.head_dim = 16;
  m.config.vocab_size = 512;
  m.config.max_position_embeddings = 64;
  m.blocks.push_back(LayoutSegment({{"input_layernorm.weight", {64}}}, "/b0", DType::kBF16, 256));
  m.rest = LayoutSegment(rest, "/rest", DType::kBF16, 256, StoreQuantFormat(QuantMethod::kFp8),
                         {"lm_head.weight"});
  for (TensorSlice& t : m.rest.tensors)
    if (t.name == "lm_head.weight_scale_inv") t.shape = {5, 1};
  CHECK_THROWS_WITH(ManifestFromJson(ManifestToJson(m), "manifest.json"),
                    Catch::Contains("rest: tensor `lm_head.weight_scale_inv`"));
}
