// In-process tests of packing, attaching and the refusals that happen before publishing.
#include <signal.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstring>
#include <fstream>
#include <functional>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "common/base/error.h"
#include "common/formats/safetensors.h"
#include "store/attach.h"
#include "store/convert.h"
#include "store/registry.h"
#include "store/server.h"
#include "test_util.h"

using namespace lorastream;
using namespace lorastream::store;
using namespace lorastream::testing;

namespace {

std::unique_ptr<PublishedStore> Serve(const std::string& dir, const std::string& name,
                                      bool to_bf16 = false) {
  store::ServeOptions o;
  o.model_dir = dir;
  o.name = name;
  o.to_bf16 = to_bf16;
  o.threads = 2;
  return PublishedStore::Build(o);
}

// Every tensor in the store equals the checkpoint's bytes (or their BF16 rounding).
void CheckAgainstSource(const AttachedStore& store, const Checkpoint& cp, bool to_bf16) {
  const Manifest& m = store.manifest();
  auto compare = [&](const std::string& full, const TensorSlice& slice, const uint8_t* data) {
    INFO(full);
    const auto ref = cp.Get(full);
    CHECK(slice.shape == ref.entry->shape);
    CHECK(slice.offset % m.alignment == 0);
    const uint8_t* src = ref.file->Data(*ref.entry);
    if (!to_bf16 || ref.entry->dtype == DType::kBF16) {
      REQUIRE(slice.nbytes == ref.entry->nbytes());
      CHECK(std::memcmp(data, src, slice.nbytes) == 0);
    } else {
      REQUIRE(slice.dtype == DType::kBF16);
      std::vector<uint16_t> expected(ref.entry->numel());
      ConvertToBF16(ref.entry->dtype, src, expected.data(), expected.size());
      REQUIRE(slice.nbytes == expected.size() * 2);
      CHECK(std::memcmp(data, expected.data(), slice.nbytes) == 0);
    }
  };
  REQUIRE(store.num_blocks() == cp.config().num_hidden_layers);
  for (int i = 0; i < store.num_blocks(); ++i) {
    const auto canonical = cp.config().BlockTensorShapes();
    REQUIRE(m.blocks[i].tensors.size() == canonical.size());
    for (size_t k = 0; k < canonical.size(); ++k) {
      const TensorSlice& slice = m.blocks[i].tensors[k];
      CHECK(slice.name == canonical[k].first);  // canonical order
      if (k > 0)
        CHECK(slice.offset >=
              m.blocks[i].tensors[k - 1].offset + m.blocks[i].tensors[k - 1].nbytes);
      compare("model.layers." + std::to_string(i) + "." + slice.name, slice,
              store.tensor_data(i, slice.name));
    }
  }
  for (const TensorSlice& slice : m.rest.tensors)
    compare(slice.name, slice, store.tensor_data(-1, slice.name));
  CHECK(m.rest.tensors.size() == cp.config().RestTensorShapes().size());
}

// Rewrites the single-file checkpoint in `dir` after `edit` changed its tensor list.
void Rewrite(const std::string& dir, const std::function<void(std::vector<TensorToWrite>&)>& edit) {
  SafetensorsFile f = SafetensorsFile::Open(dir + "/model.safetensors");
  std::vector<TensorToWrite> tensors;
  for (const SafetensorsEntry& e : f.tensors())
    tensors.push_back({e.name, e.dtype, e.shape, f.Data(e)});
  edit(tensors);
  WriteSafetensors(dir + "/model.safetensors", tensors);  // temp + rename: `f` stays valid
}

void EditConfig(const std::string& dir, const std::function<void(nlohmann::json&)>& edit) {
  std::ifstream in(dir + "/config.json");
  nlohmann::json j = nlohmann::json::parse(in);
  edit(j);
  std::ofstream(dir + "/config.json") << j.dump();
}

std::string ServeError(const std::string& dir, const std::string& name, bool to_bf16 = false) {
  try {
    Serve(dir, name, to_bf16);
  } catch (const Error& e) {
    CHECK(ShmObjectsOf(name).empty());  // refused before anything was published
    return e.what();
  }
  return "(accepted)";
}

}  // namespace

TEST_CASE("pack/attach round trip is bit-exact for every tiny preset", "[store]") {
  for (const std::string preset : {"tiny", "tiny-mistral", "tiny-qwen2", "tiny-qwen3"}) {
    INFO(preset);
    TempDir dir("store");
    Synth(preset, dir.str(), 3, "", /*shard_bytes=*/preset == "tiny-qwen3" ? 200000 : 4ull << 30);
    const std::string name = UniqueName("rt");
    auto published = Serve(dir.str(), name);
    AttachedStore store = AttachedStore::Attach(name, published->manifest().fingerprint);
    Checkpoint cp = Checkpoint::Open(dir.str());
    CheckAgainstSource(store, cp, false);
    CHECK(store.manifest().dtype == DType::kF32);
    CHECK_NOTHROW(VerifyChecksums(store, 2));
    for (int i = 0; i < store.num_blocks(); ++i) {
      CHECK(store.block_size(i) == store.manifest().blocks[i].nbytes);
      CHECK(store.block_mapped_size(i) % 4096 == 0);
      CHECK(store.block_mapped_size(i) >= store.block_size(i));
      CHECK(reinterpret_cast<uintptr_t>(store.block_data(i)) % 4096 == 0);
    }
    CHECK(store.rest_mapped_size() >= store.rest_size());
    CHECK_THROWS_WITH(AttachedStore::Attach(name, "0123456789abcdef"),
                      Catch::Contains("expected 0123456789abcdef"));
  }
}

TEST_CASE("F32 and F16 checkpoints convert to BF16 on request", "[store]") {
  for (const std::string dtype : {"f32", "f16"}) {
    INFO(dtype);
    TempDir dir("store");
    Synth("tiny", dir.str(), 5, dtype);
    const std::string name = UniqueName("bf16");
    auto published = Serve(dir.str(), name, /*to_bf16=*/true);
    AttachedStore store = AttachedStore::Attach(name);
    CHECK(store.manifest().dtype == DType::kBF16);
    CheckAgainstSource(store, Checkpoint::Open(dir.str()), true);
  }
}

TEST_CASE("same weights give the same fingerprint, other weights another", "[store]") {
  TempDir a("store");
  TempDir b("store");
  Synth("tiny", a.str(), 1);
  Synth("tiny", b.str(), 2);
  auto s1 = Serve(a.str(), UniqueName("fp"));
  const std::string f1 = s1->manifest().fingerprint;
  s1.reset();
  auto s2 = Serve(a.str(), UniqueName("fp"));
  auto s3 = Serve(b.str(), UniqueName("fp"));  // two stores side by side
  CHECK(s2->manifest().fingerprint == f1);
  CHECK(s3->manifest().fingerprint != f1);
  CHECK(s2->manifest().generation != s3->manifest().generation);
  CHECK_NOTHROW(VerifyChecksums(AttachedStore::Attach(s2->manifest().store_name)));
  CHECK_NOTHROW(VerifyChecksums(AttachedStore::Attach(s3->manifest().store_name)));
}

TEST_CASE("a write through an attached mapping faults in the writer only", "[store]") {
  TempDir dir("store");
  Synth("tiny", dir.str());
  const std::string name = UniqueName("ro");
  auto published = Serve(dir.str(), name);
  {
    const AttachedStore store = AttachedStore::Attach(name);
    CHECK(lorastream::testing::WriteFaults(store.block_data(1) + 100));
  }
  CHECK_NOTHROW(VerifyChecksums(AttachedStore::Attach(name)));
}

TEST_CASE("a second store of a live name is refused and leaves the first intact", "[store]") {
  TempDir dir("store");
  Synth("tiny", dir.str());
  const std::string name = UniqueName("dup");
  auto first = Serve(dir.str(), name);
  CHECK_THROWS_WITH(Serve(dir.str(), name),
                    Catch::Contains("is already served by pid " + std::to_string(getpid())));
  CHECK_NOTHROW(VerifyChecksums(AttachedStore::Attach(name)));
  first.reset();
  CHECK(ShmObjectsOf(name).empty());
  CHECK_THROWS_WITH(AttachedStore::Attach(name), Catch::Contains("no store named"));
  CHECK_THROWS_AS(Serve(dir.str(), "bad.name"), Error);
}

namespace {

// One way to damage a fresh tiny checkpoint, and what the refusal must say.
struct Malformed {
  const char* what;
  bool sharded;  // written as shards with an index instead of one file
  std::function<void(const std::string& dir)> damage;
  std::vector<std::string> expected;  // each part of the refusal's message
  bool to_bf16 = false;
};

void DropTensors(const std::string& dir, const std::function<bool(const std::string&)>& drop) {
  Rewrite(dir, [&](auto& t) {
    t.erase(std::remove_if(t.begin(), t.end(), [&](auto& x) { return drop(x.name); }), t.end());
  });
}

void AddTensorLike(const std::string& dir, const std::string& name) {
  Rewrite(dir, [&](auto& t) {
    TensorToWrite x = t[1];
    x.name = name;
    t.push_back(x);
  });
}

// Replaces model.norm.weight by 64 elements of `dtype` from `data` (kept alive by the caller).
void RetypeNorm(const std::string& dir, DType dtype, const void* data) {
  Rewrite(dir, [&](auto& t) {
    for (auto& x : t)
      if (x.name == "model.norm.weight") x = {x.name, dtype, {64}, data};
  });
}

std::string ReadText(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

}  // namespace

TEST_CASE("malformed checkpoints are refused before anything is published", "[store]") {
  static const std::vector<int32_t> ints(64, 1);
  static const std::vector<uint16_t> halves(64, 0x3C00);
  const std::vector<Malformed> cases = {
      {"a block tensor missing",
       false,
       [](const std::string& d) {
         DropTensors(d,
                     [](const std::string& n) { return n == "model.layers.1.mlp.up_proj.weight"; });
       },
       {"tensor `model.layers.1.mlp.up_proj.weight` is missing"}},
      {"a whole block missing",
       false,
       [](const std::string& d) {
         DropTensors(d, [](const std::string& n) { return n.rfind("model.layers.3.", 0) == 0; });
       },
       {"block 3 is missing (no tensor model.layers.3.*"}},
      {"an unknown tensor inside a block",
       false,
       [](const std::string& d) { AddTensorLike(d, "model.layers.2.mlp.extra_proj.weight"); },
       {"unexpected tensor `model.layers.2.mlp.extra_proj.weight` (not part of a llama block)"}},
      {"an unknown tensor outside the blocks",
       false,
       [](const std::string& d) { AddTensorLike(d, "vision_tower.weight"); },
       {"unexpected tensor `vision_tower.weight`"}},
      {"a tensor of the wrong shape",
       false,
       [](const std::string& d) {
         Rewrite(d, [](auto& t) {
           for (auto& x : t)
             if (x.name == "model.layers.0.self_attn.q_proj.weight") x.shape = {32, 128};
         });
       },
       {"tensor `model.layers.0.self_attn.q_proj.weight` has shape [32, 128] but config.json "
        "implies [64, 64]"}},
      {"fewer layers in config.json than in the weights",
       false,
       [](const std::string& d) { EditConfig(d, [](auto& j) { j["num_hidden_layers"] = 3; }); },
       {"belongs to block 3 but config.json has num_hidden_layers = 3"}},
      {"a hidden size that does not match the weights",
       false,
       [](const std::string& d) { EditConfig(d, [](auto& j) { j["hidden_size"] = 128; }); },
       {"config.json implies"}},
      {"a config.json field missing",
       false,
       [](const std::string& d) { EditConfig(d, [](auto& j) { j.erase("vocab_size"); }); },
       {"field `vocab_size` is missing"}},
      {"a non-block tensor missing",
       false,
       [](const std::string& d) {
         DropTensors(d, [](const std::string& n) { return n == "model.norm.weight"; });
       },
       {"tensor `model.norm.weight` is missing"}},
      {"an integer weight",
       false,
       [](const std::string& d) { RetypeNorm(d, DType::kI32, ints.data()); },
       {"tensor `model.norm.weight` is I32; the store holds floating-point weights"}},
      {"mixed float dtypes",
       false,
       [](const std::string& d) { RetypeNorm(d, DType::kF16, halves.data()); },
       {"serve with --dtype bf16 to convert"}},
      {"mixed float dtypes, converted to bf16 (accepted)",
       false,
       [](const std::string& d) { RetypeNorm(d, DType::kF16, halves.data()); },
       {"(accepted)"},
       /*to_bf16=*/true},
      {"an index that is not JSON",
       true,
       [](const std::string& d) {
         std::ofstream(d + "/model.safetensors.index.json") << "{\"weight_map\": ";
       },
       {"model.safetensors.index.json: not valid JSON"}},
      {"a shard the index names missing",
       true,
       [](const std::string& d) {
         const std::string text = ReadText(d + "/model.safetensors.index.json");
         const std::string of = text.find("of-00004") != std::string::npos ? "00004" : "00005";
         std::remove((d + "/model-00002-of-" + of + ".safetensors").c_str());
       },
       {"model.safetensors.index.json: shard `model-00002-of-", "does not exist"}},
      {"no config.json",
       false,
       [](const std::string& d) { std::remove((d + "/config.json").c_str()); },
       {"no config.json"}},
      {"a truncated safetensors file",
       false,
       [](const std::string& d) {
         REQUIRE(::truncate((d + "/model.safetensors").c_str(), 5000) == 0);
       },
       {"model.safetensors: tensor `"}},
  };
  const std::string name = UniqueName("bad");
  for (const Malformed& c : cases) {
    INFO(c.what);
    const testing::TempDir dir("store");
    Synth("tiny", dir.str(), 9, "", /*shard_bytes=*/c.sharded ? 250000 : 4ull << 30);
    c.damage(dir.str());
    const std::string refusal = ServeError(dir.str(), name, c.to_bf16);
    for (const std::string& part : c.expected) CHECK_THAT(refusal, Catch::Contains(part));
  }
}

TEST_CASE("a store larger than /dev/shm is refused with the size and the fix", "[store]") {
  // A sparse checkpoint of 32 GB of F32 (only its header is real): bigger than /dev/shm here.
  struct statvfs vfs {};
  if (statvfs("/dev/shm", &vfs) == 0 && uint64_t{vfs.f_bavail} * vfs.f_frsize > (31ull << 30)) {
    WARN("skipped: /dev/shm has room for 32 GB here");
    return;
  }
  TempDir d("store");
  ModelConfig c;
  c.model_type = "llama";
  c.hidden_size = 4096;
  c.intermediate_size = 14336;
  c.num_hidden_layers = 32;
  c.num_attention_heads = 32;
  c.num_key_value_heads = 8;
  c.head_dim = 128;
  c.vocab_size = 128256;
  c.max_position_embeddings = 8192;
  c.torch_dtype = "float32";
  nlohmann::json cj;
  ToJson(cj, c);
  std::ofstream(d.str() + "/config.json") << cj.dump();
  nlohmann::json header = nlohmann::json::object();
  uint64_t offset = 0;
  auto add = [&](const std::string& name, const std::vector<int64_t>& shape) {
    uint64_t n = 4;
    for (int64_t x : shape) n *= x;
    header[name] = {{"dtype", "F32"}, {"shape", shape}, {"data_offsets", {offset, offset + n}}};
    offset += n;
  };
  for (int i = 0; i < c.num_hidden_layers; ++i)
    for (const auto& [rel, shape] : c.BlockTensorShapes())
      add("model.layers." + std::to_string(i) + "." + rel, shape);
  for (const auto& [name, shape] : c.RestTensorShapes()) add(name, shape);
  const std::string text = header.dump();
  {
    std::ofstream out(d.str() + "/model.safetensors", std::ios::binary);
    const uint64_t n = text.size();
    out.write(reinterpret_cast<const char*>(&n), 8);
    out << text;
  }
  REQUIRE(::truncate((d.str() + "/model.safetensors").c_str(),
                     static_cast<off_t>(8 + text.size() + offset)) == 0);
  {
    // A NaN as the first weight: the space refusal must come first, before a scan that would
    // read all 32 GB (minutes on a disk; under ThreadSanitizer, shadow memory for all of it).
    std::fstream out(d.str() + "/model.safetensors",
                     std::ios::binary | std::ios::in | std::ios::out);
    out.seekp(static_cast<std::streamoff>(8 + text.size()));
    const uint32_t nan_bits = 0x7fc00000;
    out.write(reinterpret_cast<const char*>(&nan_bits), 4);
    REQUIRE(out.good());
  }
  const std::string name = UniqueName("big");
  try {
    Serve(d.str(), name);
    FAIL("a 32 GB store was accepted");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kResource);
    CHECK_THAT(e.what(), Catch::Contains("the store needs 29.92 GiB") &&
                             Catch::Contains("of /dev/shm, which has"));
    CHECK_THAT(e.what(), Catch::Contains("mount -o remount,size="));
  }
  CHECK(ShmObjectsOf(name).empty());
}

TEST_CASE("a signal during loading cancels it and removes what was created", "[store]") {
  TempDir d("store");
  Synth("tiny", d.str());
  const std::string name = UniqueName("cancel");
  store::ServeOptions o;
  o.model_dir = d.str();
  o.name = name;
  std::atomic<bool> segments_existed{false};  // the loading threads poll at once
  try {
    PublishedStore::Build(o, [&] {
      if (ShmObjectsOf(name).size() == 4 + 1 + 1) segments_existed = true;  // polled mid-load
      return true;
    });
    FAIL("not cancelled");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kCancelled);
  }
  CHECK(segments_existed.load());
  CHECK(ShmObjectsOf(name).empty());
}
