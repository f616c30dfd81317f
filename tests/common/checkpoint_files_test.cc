// Checkpoint durability without torch: SHA-256, the checkpoint manifest, the trainer state's
// metadata, and the output folder's rules (verify on resume, fall back, retention, stale
// temporaries). tests/worker/trainer_test.cc drives the same code through real training.
#include <fcntl.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <sstream>

#include "common/base/error.h"
#include "common/base/sha256.h"
#include "common/formats/checkpoint_dir.h"
#include "common/formats/checkpoint_manifest.h"
#include "common/formats/safetensors.h"
#include "common/formats/trainer_state_meta.h"
#include "common/posix/durable_file.h"
#include "common/posix/remove_tree.h"
#include "common/posix/unique_fd.h"
#include "tests/support/test_support.h"

using namespace lorastream;
namespace fs = std::filesystem;

namespace {

std::string Slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

fs::path WriteCheckpoint(const fs::path& out, int64_t step, double eval_loss = NAN,
                         int64_t recorded_step = -1) {
  return lorastream::testing::WriteTestCheckpoint(out, step, eval_loss, recorded_step);
}

void FlipLowBit(const fs::path& file, uint64_t offset_from_end) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(-static_cast<std::streamoff>(offset_from_end), std::ios::end);
  char c = 0;
  f.get(c);
  f.seekp(-static_cast<std::streamoff>(offset_from_end), std::ios::end);
  f.put(static_cast<char>(c ^ 1));
}

std::string FaultOf(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kCorrupt);
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("SHA-256 matches the FIPS 180-4 test vectors, fed whole or piecewise", "[common]") {
  auto hex = [](const std::string& s) {
    Sha256 h;
    h.Update(s.data(), s.size());
    return h.HexDigest();
  };
  CHECK(hex("") == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  CHECK(hex("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  CHECK(hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq") ==
        "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  Sha256 million;
  const std::string chunk(997, 'a');  // odd pieces cross every block boundary
  size_t fed = 0;
  while (fed < 1000000) {
    const size_t n = std::min(chunk.size(), 1000000 - fed);
    million.Update(chunk.data(), n);
    fed += n;
  }
  CHECK(million.HexDigest() == "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST_CASE("checkpoint manifests round-trip and malformed ones are refused, naming the entry",
          "[common]") {
  CheckpointManifest m;
  m.files.push_back({"adapter_model.safetensors", 12, std::string(64, 'a')});
  m.files.push_back({"trainer_state.safetensors", 0, std::string(64, '0')});
  const CheckpointManifest back = ParseCheckpointManifest(CheckpointManifestJson(m), "m.json");
  REQUIRE(back.files.size() == 2);
  CHECK(back.files[0].name == "adapter_model.safetensors");
  CHECK(back.files[0].bytes == 12);
  CHECK(back.files[1].sha256 == std::string(64, '0'));

  const std::string sha = std::string(64, 'b');
  auto with_files = [&](const std::string& files) {
    return "{\"format\": \"lorastream-checkpoint-manifest\", \"version\": 1, \"files\": " + files +
           "}";
  };
  auto fault = [](const std::string& text) {
    return FaultOf([&] { ParseCheckpointManifest(text, "m.json"); });
  };
  CHECK_THAT(fault("not json"), Catch::Contains("m.json: not a JSON object"));
  CHECK_THAT(fault("{\"format\": \"x\", \"version\": 1, \"files\": []}"),
             Catch::Contains("not a version 1"));
  CHECK_THAT(fault(with_files("[]")), Catch::Contains("`files` must be a non-empty array"));
  CHECK_THAT(fault(with_files("[{\"name\": \"../x\", \"bytes\": 1, \"sha256\": \"" + sha + "\"}]")),
             Catch::Contains("`files[0]`: `name` must be a plain file name"));
  CHECK_THAT(fault(with_files("[{\"name\": \"a\", \"bytes\": -1, \"sha256\": \"" + sha + "\"}]")),
             Catch::Contains("`bytes`"));
  CHECK_THAT(fault(with_files("[{\"name\": \"a\", \"bytes\": 1, \"sha256\": \"ABC\"}]")),
             Catch::Contains("`sha256`"));
  CHECK_THAT(
      fault(with_files("[{\"name\": \"a\", \"bytes\": 1, \"sha256\": \"" + sha +
                       "\"}, {\"name\": \"a\", \"bytes\": 1, \"sha256\": \"" + sha + "\"}]")),
      Catch::Contains("`files[1]`: `a` is listed twice"));
}

TEST_CASE("trainer state metadata parses strictly and carries the eval loss", "[common]") {
  TrainerStateMeta m;
  m.step = 12;
  m.samples_seen = 96;
  m.seed = std::numeric_limits<uint64_t>::max();
  m.fingerprint = "rank=4";
  auto fields = TrainerStateMetadata(m);
  CHECK(fields.at("eval_loss") == "nan");
  TrainerStateMeta back = ParseTrainerStateMetadata(fields, "ts");
  CHECK(back.step == 12);
  CHECK(back.samples_seen == 96);
  CHECK(back.seed == m.seed);
  CHECK(std::isnan(back.eval_loss));
  m.eval_loss = 1.2345678901234567;
  CHECK(ParseTrainerStateMetadata(TrainerStateMetadata(m), "ts").eval_loss == m.eval_loss);
  fields.erase("eval_loss");  // written before eval losses existed
  CHECK(std::isnan(ParseTrainerStateMetadata(fields, "ts").eval_loss));

  auto fault = [&](const std::string& key, const std::string& value) {
    auto f = TrainerStateMetadata(m);
    f[key] = value;
    return FaultOf([&] { ParseTrainerStateMetadata(f, "ts"); });
  };
  CHECK_THAT(fault("step", "-1"), Catch::Contains("ts: metadata `step`"));
  CHECK_THAT(fault("step", " 5"), Catch::Contains("`step`"));
  CHECK_THAT(fault("step", "1e3"), Catch::Contains("`step`"));
  CHECK_THAT(fault("step", "9223372036854775808"), Catch::Contains("`step`"));
  CHECK_THAT(fault("seed", "18446744073709551616"), Catch::Contains("`seed`"));
  CHECK_THAT(fault("eval_loss", "inf"), Catch::Contains("`eval_loss`"));
  CHECK_THAT(fault("eval_loss", "-0.5"), Catch::Contains("`eval_loss`"));
  CHECK_THAT(fault("version", "2"), Catch::Contains("not a version 1"));
  auto missing = TrainerStateMetadata(m);
  missing.erase("fingerprint");
  CHECK_THAT(FaultOf([&] { ParseTrainerStateMetadata(missing, "ts"); }),
             Catch::Contains("metadata `fingerprint` is missing"));
}

TEST_CASE("a damaged newest checkpoint is skipped for the previous one; none usable is an error",
          "[common]") {
  lorastream::testing::TempDir out("ckpt-verify");
  const fs::path c2 = WriteCheckpoint(out.path(), 2);
  const fs::path c4 = WriteCheckpoint(out.path(), 4);
  CHECK(FindResumableCheckpoint(out.path().string()) == c4.string());
  CHECK(VerifyCheckpoint({4, c4.string()}).samples_seen == 16);

  // One low bit of the adapter's last weight.
  FlipLowBit(c4 / "adapter_model.safetensors", 4);
  CHECK_THAT(FaultOf([&] {
               VerifyCheckpoint({4, c4.string()});
             }),
             Catch::Contains("adapter_model.safetensors: contents differ from the SHA-256"));
  CHECK(FindResumableCheckpoint(out.path().string()) == c2.string());

  // The trainer state deleted: an error naming it, never a fresh start.
  fs::remove(c2 / kTrainerStateFile);
  std::string all = FaultOf([&] { FindResumableCheckpoint(out.path().string()); });
  CHECK_THAT(all, Catch::Contains("no usable checkpoint"));
  CHECK_THAT(all, Catch::Contains("checkpoint-2/trainer_state.safetensors: missing"));
  CHECK_THAT(all, Catch::Contains("checkpoint-4/adapter_model.safetensors"));
  CHECK(fs::exists(c2));  // nothing is deleted on the way
  CHECK(fs::exists(c4));

  // An empty folder (or none) is a fresh start.
  lorastream::testing::TempDir empty("ckpt-empty");
  CHECK(FindResumableCheckpoint(empty.path().string()).empty());
}

TEST_CASE("an edited step, a truncated file or a missing manifest is caught", "[common]") {
  lorastream::testing::TempDir out("ckpt-edit");
  const fs::path c3 = WriteCheckpoint(out.path(), 3);
  // Rewrite the trainer state with step 30 (same length as a crafted edit would keep).
  const std::string original = Slurp(c3 / kTrainerStateFile);
  std::string edited = original;
  const size_t at = edited.find("\"step\":\"3\"");
  REQUIRE(at != std::string::npos);
  edited.replace(at, 10, "\"step\":\"9\"");
  std::ofstream(c3 / kTrainerStateFile, std::ios::binary | std::ios::trunc) << edited;
  CHECK_THAT(FaultOf([&] {
               VerifyCheckpoint({3, c3.string()});
             }),
             Catch::Contains("trainer_state.safetensors: contents differ"));
  std::ofstream(c3 / kTrainerStateFile, std::ios::binary | std::ios::trunc) << original;
  CHECK_NOTHROW(VerifyCheckpoint({3, c3.string()}));

  // A checksum-consistent folder whose state names another step (a renamed folder).
  const fs::path c5 = WriteCheckpoint(out.path(), 5, NAN, /*recorded_step=*/7);
  CHECK_THAT(FaultOf([&] {
               VerifyCheckpoint({5, c5.string()});
             }),
             Catch::Contains("records step 7 in a folder named checkpoint-5"));

  fs::resize_file(c3 / "adapter_config.json", 2);
  CHECK_THAT(FaultOf([&] {
               VerifyCheckpoint({3, c3.string()});
             }),
             Catch::Contains("adapter_config.json: 2 bytes, the manifest recorded"));
  fs::remove(c3 / kCheckpointManifestFile);
  CHECK_THAT(FaultOf([&] {
               VerifyCheckpoint({3, c3.string()});
             }),
             Catch::Contains("checkpoint_manifest.json: missing"));
}

TEST_CASE("retention keeps the newest K complete checkpoints and, asked, the best", "[common]") {
  lorastream::testing::TempDir out("ckpt-keep");
  WriteCheckpoint(out.path(), 1, 2.5);
  WriteCheckpoint(out.path(), 2, 1.25);  // the best
  WriteCheckpoint(out.path(), 3, 1.5);
  WriteCheckpoint(out.path(), 4);                       // no eval at this step
  fs::create_directories(out.path() / "checkpoint-5");  // incomplete: no manifest
  CHECK(FindBestCheckpoint(out.path().string()) == (out.path() / "checkpoint-2").string());

  PruneCheckpoints(out.path().string(), 5, 2, /*keep_best=*/true);
  std::vector<int64_t> left;
  for (const auto& c : ListCheckpoints(out.path().string())) left.push_back(c.step);
  CHECK(left == std::vector<int64_t>{4, 3, 2});

  PruneCheckpoints(out.path().string(), 5, 1, /*keep_best=*/false);
  left.clear();
  for (const auto& c : ListCheckpoints(out.path().string())) left.push_back(c.step);
  CHECK(left == std::vector<int64_t>{4});
  CHECK(FindBestCheckpoint(out.path().string()).empty());

  // A fresh run saving step 2 over the folder: the old run's later checkpoints go.
  WriteCheckpoint(out.path(), 2);
  PruneCheckpoints(out.path().string(), 2, 2, /*keep_best=*/false);
  left.clear();
  for (const auto& c : ListCheckpoints(out.path().string())) left.push_back(c.step);
  CHECK(left == std::vector<int64_t>{2});
}

TEST_CASE("temporaries of an interrupted save are removed, nothing else", "[common]") {
  lorastream::testing::TempDir out("ckpt-tmp");
  fs::create_directories(out.path() / ".checkpoint-7.tmp" / "sub");
  std::ofstream(out.path() / ".checkpoint-7.tmp" / "adapter_model.safetensors") << "half";
  fs::create_directories(out.path() / ".checkpoint-x.tmp");
  std::ofstream(out.path() / "notes.tmp") << "mine";
  RemoveStaleCheckpointTemporaries(out.path().string());
  CHECK(!fs::exists(out.path() / ".checkpoint-7.tmp"));
  CHECK(fs::exists(out.path() / ".checkpoint-x.tmp"));
  CHECK(fs::exists(out.path() / "notes.tmp"));
  CHECK(CheckpointStepOf("checkpoint-12") == 12);
  CHECK(CheckpointStepOf("checkpoint-012") == -1);
  CHECK(CheckpointStepOf("checkpoint-") == -1);
  CHECK(CheckpointStepOf("checkpoint-99999999999999999999") == -1);
}

TEST_CASE("a failed write is reported, naming the file", "[common]") {
  if (!fs::exists("/dev/full")) return;
  UniqueFd full(::open("/dev/full", O_WRONLY | O_CLOEXEC));
  REQUIRE(full.valid());
  try {
    WriteAll(full.get(), "x", 1, "/dev/full");
    FAIL("writing into /dev/full succeeded");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kIo);
    CHECK_THAT(e.what(), Catch::Contains("cannot write /dev/full"));
  }
  lorastream::testing::TempDir out("durable");
  WriteFileDurably((out.path() / "f").string(), "hello");
  CHECK(Slurp(out.path() / "f") == "hello");
  CHECK(!fs::exists(out.path() / "f.tmp"));
}

TEST_CASE("keep_best: OUTPUT_DIR/best holds a copy of the best checkpoint's adapter", "[common]") {
  lorastream::testing::TempDir out("ckpt-best");
  const std::string dir = out.path().string();
  WriteCheckpoint(out.path(), 1, 2.5);
  const fs::path c2 = WriteCheckpoint(out.path(), 2, 1.25);  // the best
  WriteCheckpoint(out.path(), 3, 1.5);
  PruneCheckpoints(dir, 3, 1, /*keep_best=*/true);
  REQUIRE(BestAdapterDir(dir) == (out.path() / "best").string());
  const fs::path best = out.path() / "best";
  CHECK(Slurp(best / "adapter_model.safetensors") == Slurp(c2 / "adapter_model.safetensors"));
  CHECK(Slurp(best / "adapter_config.json") == Slurp(c2 / "adapter_config.json"));
  CHECK_FALSE(fs::exists(best / kTrainerStateFile));  // the adapter alone
  CHECK_FALSE(fs::exists(best / kCheckpointManifestFile));
  CHECK_THAT(Slurp(best / kBestAdapterNote), Catch::Contains("\"checkpoint-2\""));
  // best/ is not a checkpoint: retention and resume ignore it.
  std::vector<int64_t> left;
  for (const auto& c : ListCheckpoints(dir)) left.push_back(c.step);
  CHECK(left == std::vector<int64_t>{3, 2});

  // A better checkpoint replaces it; without keep_best nothing is written.
  const fs::path c4 = WriteCheckpoint(out.path(), 4, 1.0);
  PruneCheckpoints(dir, 4, 1, /*keep_best=*/true);
  CHECK(Slurp(best / "adapter_model.safetensors") == Slurp(c4 / "adapter_model.safetensors"));
  CHECK_THAT(Slurp(best / kBestAdapterNote), Catch::Contains("\"checkpoint-4\""));
  CHECK_FALSE(fs::exists(out.path() / ".best.tmp"));
  CHECK_FALSE(fs::exists(out.path() / ".best.old"));
  lorastream::testing::TempDir plain("ckpt-nobest");
  WriteCheckpoint(plain.path(), 1, 2.5);
  PruneCheckpoints(plain.path().string(), 1, 1, /*keep_best=*/false);
  CHECK(BestAdapterDir(plain.path().string()).empty());
}
