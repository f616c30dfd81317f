#include "common/formats/safetensors.h"

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <set>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "common/base/error.h"
#include "tests/support/test_support.h"

using namespace lorastream;

namespace {

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A file with the given header text (length prefix computed) and `data_bytes` zero bytes.
std::string WithHeader(const std::string& header, size_t data_bytes) {
  std::string out(8, '\0');
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(n >> (8 * i));
  return out + header + std::string(data_bytes, '\0');
}

std::string ParseError(const std::string& bytes) {
  try {
    ParseSafetensorsHeader(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), "f.st");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kCorrupt);
    return e.what();
  }
  return "(accepted)";
}

std::string OpenError(const std::string& path) {
  try {
    SafetensorsFile::Open(path);
  } catch (const Error& e) {
    return e.what();
  }
  return "(accepted)";
}

}  // namespace

TEST_CASE("safetensors round trip of every dtype with metadata", "[common]") {
  const testing::TempDir temp("st");
  const std::string& dir = temp.str();
  const DType all[] = {DType::kBool, DType::kU8,  DType::kI8,  DType::kI16,    DType::kU16,
                       DType::kI32,  DType::kU32, DType::kI64, DType::kU64,    DType::kF16,
                       DType::kBF16, DType::kF32, DType::kF64, DType::kF8E4M3, DType::kF8E5M2};
  std::vector<std::vector<uint8_t>> buffers;
  std::vector<TensorToWrite> tensors;
  int k = 0;
  for (DType d : all) {
    TensorToWrite t;
    t.name = std::string("t.") + DTypeName(d);
    t.dtype = d;
    t.shape = {3, k + 1};
    std::vector<uint8_t> bytes(3 * (k + 1) * DTypeSize(d));
    for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i * 7 + k);
    buffers.push_back(bytes);
    t.data = buffers.back().data();
    tensors.push_back(t);
    ++k;
  }
  tensors.push_back({"scalar", DType::kF32, {}, buffers[11].data()});
  tensors.push_back({"empty", DType::kF32, {0, 4}, nullptr});
  // buffers may have reallocated: refresh the pointers.
  for (size_t i = 0; i < buffers.size(); ++i) tensors[i].data = buffers[i].data();
  tensors[15].data = buffers[11].data();

  const std::string path = dir + "/all.safetensors";
  WriteSafetensors(path, tensors, {{"format", "pt"}, {"note", "x"}}, 256);
  SafetensorsFile f = SafetensorsFile::Open(path);
  CHECK(f.header().metadata.at("format") == "pt");
  CHECK(f.header().metadata.at("note") == "x");
  CHECK(f.header().data_offset % 256 == 0);
  REQUIRE(f.tensors().size() == tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const SafetensorsEntry* e = f.Find(tensors[i].name);
    REQUIRE(e != nullptr);
    CHECK(e->dtype == tensors[i].dtype);
    CHECK(e->shape == tensors[i].shape);
    if (e->nbytes() == 0) continue;
    CHECK(std::memcmp(f.Data(*e), tensors[i].data, e->nbytes()) == 0);
  }
  // The reference reader (Rust safetensors, used by transformers and peft) accepts only
  // contiguous data: in offset order each tensor starts where the previous one ended.
  uint64_t expected_begin = 0;
  for (const SafetensorsEntry& e : f.tensors()) {  // sorted by begin
    CHECK(e.begin == expected_begin);
    expected_begin = e.end;
  }
  CHECK(f.Find("missing") == nullptr);
  // Move keeps the mapping valid.
  SafetensorsFile g = std::move(f);
  CHECK(g.Find("scalar")->nbytes() == 4);
}

TEST_CASE("sharded checkpoint with an index is read and cross-checked", "[common]") {
  const testing::TempDir temp("st");
  const std::string& dir = temp.str();
  WriteBytes(dir + "/config.json",
             R"({"model_type":"llama","hidden_size":8,"intermediate_size":16,)"
             R"("num_hidden_layers":1,"num_attention_heads":2,"vocab_size":10})");
  std::vector<float> a(8, 1.0f), b(16, 2.0f);
  WriteSafetensors(dir + "/s1.safetensors", {{"a", DType::kF32, {8}, a.data()}});
  WriteSafetensors(dir + "/s2.safetensors", {{"b", DType::kF32, {4, 4}, b.data()}});
  auto index = [&](const std::string& text) {
    WriteBytes(dir + "/model.safetensors.index.json", text);
  };
  index(R"({"metadata":{},"weight_map":{"a":"s1.safetensors","b":"s2.safetensors"}})");
  Checkpoint cp = Checkpoint::Open(dir);
  CHECK(cp.config().hidden_size == 8);
  CHECK(cp.AllTensors().size() == 2);
  CHECK(cp.Has("b"));
  CHECK(reinterpret_cast<const float*>(cp.Get("b").file->Data(*cp.Get("b").entry))[5] == 2.0f);
  CHECK_THROWS_WITH(cp.Get("zz"), Catch::Contains("no tensor `zz`"));

  auto open_error = [&]() -> std::string {
    try {
      Checkpoint::Open(dir);
    } catch (const Error& e) {
      return e.what();
    }
    return "(accepted)";
  };
  index("{not json");
  CHECK_THAT(open_error(), Catch::Contains("model.safetensors.index.json: not valid JSON"));
  index(R"({"metadata":{}})");
  CHECK_THAT(open_error(), Catch::Contains("`weight_map` is missing"));
  index(R"({"weight_map":{"a":"s1.safetensors","b":"gone.safetensors"}})");
  CHECK_THAT(open_error(), Catch::Contains("shard `gone.safetensors` (tensor `b`) does not exist"));
  index(R"({"weight_map":{"a":"s1.safetensors","b":"s1.safetensors"}})");
  CHECK_THAT(
      open_error(),
      Catch::Contains("tensor `b` is assigned to shard `s1.safetensors`, which does not hold it"));
  WriteSafetensors(dir + "/s3.safetensors",
                   {{"b", DType::kF32, {4, 4}, b.data()}, {"c", DType::kF32, {8}, a.data()}});
  index(R"({"weight_map":{"a":"s1.safetensors","b":"s3.safetensors"}})");
  CHECK_THAT(open_error(),
             Catch::Contains("tensor `c` of shard `s3.safetensors` is not listed in weight_map"));
  WriteSafetensors(dir + "/s4.safetensors",
                   {{"a", DType::kF32, {8}, a.data()}, {"d", DType::kF32, {8}, a.data()}});
  index(R"({"weight_map":{"a":"s1.safetensors","d":"s4.safetensors"}})");
  CHECK_THAT(open_error(), Catch::Contains("tensor `a` appears in shard `s4.safetensors` too, but "
                                           "weight_map assigns it to `s1.safetensors`"));
  index(R"({"weight_map":{"a":"../s1.safetensors"}})");
  CHECK_THAT(open_error(), Catch::Contains("not a file in the checkpoint folder"));
  index(R"({"weight_map":{"a":7}})");
  CHECK_THAT(open_error(), Catch::Contains("is not a file name"));
  std::remove((dir + "/model.safetensors.index.json").c_str());
  CHECK_THAT(open_error(),
             Catch::Contains("neither model.safetensors nor model.safetensors.index.json"));
  // Only PyTorch's pickle: the message names it and the conversion.
  std::vector<std::string> shards;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    if (e.path().extension() == ".safetensors") shards.push_back(e.path().string());
  for (const std::string& shard : shards) std::remove(shard.c_str());
  std::ofstream(dir + "/pytorch_model.bin") << "pickle";
  CHECK_THAT(open_error(), Catch::Contains("found pytorch_model.bin") &&
                               Catch::Contains("save_pretrained(DIR, safe_serialization=True)"));
  std::remove((dir + "/pytorch_model.bin").c_str());
  std::remove((dir + "/config.json").c_str());
  CHECK_THAT(open_error(), Catch::Contains("no config.json"));
}

TEST_CASE("malformed safetensors files are each rejected with their own error", "[common]") {
  const std::string good = R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})";
  CHECK(ParseError(WithHeader(good, 16)) == "(accepted)");

  std::string huge(8, '\0');
  huge[5] = 0x10;  // 2^44
  const std::pair<std::string, std::string> cases[] = {
      {"", "f.st: file is 0 bytes, too short for the 8-byte header length"},
      {std::string("\x05\0\0", 3), "f.st: file is 3 bytes, too short"},
      {huge + "{}", "f.st: header length 17592186044416 exceeds the cap of 104857600 bytes"},
      {WithHeader(good, 16).substr(0, 40), "runs past the end of the file (40 bytes)"},
      {WithHeader("", 0), "f.st: header is empty (length 0)"},
      {WithHeader("{\"w\": {\"dtype\": \"F32\"", 0), "f.st: header is not valid JSON"},
      {WithHeader("[1, 2]", 0), "f.st: header JSON is not an object"},
      {WithHeader(std::string(100, '[') + std::string(100, ']'), 0), "nests deeper than 32 levels"},
      {WithHeader(
           R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
           8),
       "f.st: tensor `w` appears twice in the header"},
      {WithHeader(R"({"w":{"dtype":"F32","dtype":"F16","shape":[1],"data_offsets":[0,4]}})", 4),
       "key `dtype` appears twice in one header entry"},
      {WithHeader(R"({"__metadata__":[1]})", 0),
       "f.st: `__metadata__` must be an object of strings"},
      {WithHeader(R"({"__metadata__":{"k":1}})", 0),
       "f.st: `__metadata__` key `k` is not a string"},
      {WithHeader(R"({"w":5})", 0), "f.st: tensor `w`: entry is not an object"},
      {WithHeader(R"({"w":{"shape":[1],"data_offsets":[0,4]}})", 4),
       "tensor `w`: `dtype` is missing or not a string"},
      {WithHeader(R"({"w":{"dtype":"Q4","shape":[1],"data_offsets":[0,4]}})", 4),
       "tensor `w`: unknown dtype `Q4`"},
      {WithHeader(R"({"w":{"dtype":"F32","data_offsets":[0,4]}})", 4),
       "tensor `w`: `shape` is missing or not an array"},
      {WithHeader(R"({"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4),
       "tensor `w`: `shape` must hold non-negative integers"},
      {WithHeader(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4]}})",
                  4),
       "tensor `w`: shape [4294967296, 4294967296] is too large"},
      {WithHeader(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0]}})", 4),
       "tensor `w`: `data_offsets` must be [begin, end]"},
      {WithHeader(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[8,4]}})", 8),
       "tensor `w`: data_offsets begin 8 is after end 4"},
      {WithHeader(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 4),
       "tensor `w`: data_offsets end 8 is past the data section (4 bytes)"},
      {WithHeader(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8),
       "tensor `w`: shape [3] of F32 needs 12 bytes but data_offsets span 8"},
      {WithHeader(
           R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
           12),
       "f.st: tensors `a` [0, 8) and `b` [4, 12) overlap"},
      {WithHeader(R"({"":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 4),
       "f.st: a tensor has an empty name"},
  };
  std::set<std::string> messages;
  for (const auto& [bytes, expected] : cases) {
    INFO(expected);
    const std::string message = ParseError(bytes);
    CHECK_THAT(message, Catch::Contains(expected));
    messages.insert(message);
  }
  CHECK(messages.size() == sizeof(cases) / sizeof(cases[0]));  // every error is distinct
}

TEST_CASE("SafetensorsFile::Open names the file for missing, empty and non-regular files",
          "[common]") {
  const testing::TempDir temp("st");
  const std::string& dir = temp.str();
  CHECK_THAT(OpenError(dir + "/nope.safetensors"),
             Catch::Contains("nope.safetensors: no such file"));
  CHECK_THAT(OpenError(dir), Catch::Contains(": not a regular file"));
  WriteBytes(dir + "/empty.safetensors", "");
  CHECK_THAT(OpenError(dir + "/empty.safetensors"),
             Catch::Contains("empty.safetensors: file is 0 bytes"));
  WriteBytes(dir + "/bad.safetensors",
             WithHeader(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 4));
  CHECK_THAT(OpenError(dir + "/bad.safetensors"),
             Catch::Contains("bad.safetensors: tensor `w`: data_offsets end 8 is past"));
}

TEST_CASE("streamed writer fills tensors chunk by chunk", "[common]") {
  const testing::TempDir temp("st");
  const std::string& dir = temp.str();
  std::vector<TensorToWrite> specs = {{"x", DType::kU8, {1000}, nullptr},
                                      {"y", DType::kI32, {10, 10}, nullptr}};
  WriteSafetensorsStreamed(
      dir + "/s.safetensors", specs,
      [](size_t index, uint64_t offset, uint8_t* out, size_t n) {
        for (size_t i = 0; i < n; ++i) out[i] = static_cast<uint8_t>(index * 100 + offset + i);
      },
      {}, 64, /*chunk_bytes=*/96);
  SafetensorsFile f = SafetensorsFile::Open(dir + "/s.safetensors");
  const uint8_t* x = f.Data(*f.Find("x"));
  for (int i = 0; i < 1000; ++i) REQUIRE(x[i] == static_cast<uint8_t>(i));
  const uint8_t* y = f.Data(*f.Find("y"));
  for (int i = 0; i < 400; ++i) REQUIRE(y[i] == static_cast<uint8_t>(100 + i));
}
