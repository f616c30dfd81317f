// TensorBoard event files: the record framing and protobuf encoding checked against known
// values, and the files a real `lorastream coordinator --tensorboard DIR` writes as step
// statistics arrive, read back by an independent reader (tests/tools/read_tfevents.py: its own
// CRC32C and protobuf decoding, standard-library Python).
#include "coordinator/daemon/tensorboard.h"

#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/posix/subprocess.h"
#include "tests/coordinator/cluster_fixture.h"

using namespace lorastream;
using namespace lorastream::coordinator;
using namespace lorastream::client;
using namespace lorastream::testing;

namespace {

// The reader's JSON for LOGDIR; *code its exit status.
nlohmann::json ReadEvents(const std::string& logdir, int* code) {
  std::string out = RunAndCapture(
      {"python3", std::string(LORASTREAM_SOURCE_DIR) + "/tests/tools/read_tfevents.py", logdir},
      code, 60, logdir + ".reader.stderr");
  return *code == 0 ? nlohmann::json::parse(out) : nlohmann::json();
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

}  // namespace

TEST_CASE("tensorboard: CRC32C, record framing and the Event encoding", "[coordinator]") {
  // The CRC-32C check value (RFC 3720) and TFRecord's mask.
  CHECK(Crc32c("123456789", 9) == 0xe3069283u);
  const uint32_t c = Crc32c("abc", 3);
  CHECK(MaskedCrc32c("abc", 3) == ((c >> 15) | (c << 17)) + 0xa282ead8u);
  const std::string framed = FrameRecord("xyz");
  REQUIRE(framed.size() == 8 + 4 + 3 + 4);
  uint64_t length = 0;
  std::memcpy(&length, framed.data(), 8);
  CHECK(length == 3);
  CHECK(framed.substr(12, 3) == "xyz");
  // Event{wall_time: 1.5, step: 300, summary {value {tag: "a" simple_value: 2}}}, as protoc
  // encodes it: 09 <8 bytes double> 10 ac 02 2a 0a 0a 08 0a 01 61 15 <4 bytes float>.
  const std::string e = EncodeScalarsEvent(1.5, 300, {{"a", 2.0f}});
  const std::string want_head = std::string("\x09", 1) + std::string("\0\0\0\0\0\0\xf8\x3f", 8) +
                                "\x10\xac\x02\x2a\x0a\x0a\x08\x0a\x01"
                                "a"
                                "\x15";
  CHECK(e.substr(0, want_head.size()) == want_head);
  CHECK(e.substr(want_head.size()) == std::string("\0\0\0\x40", 4));
  CHECK(EncodeFileVersionEvent(0).substr(9) ==
        "\x1a\x0d"
        "brain.Event:2");
  CHECK(RunName(12, "my job/../x") == "job-12-my_job_.._x");
  CHECK(RunName(3, "..") == "job-3-job");
}

TEST_CASE(
    "tensorboard: the writer's files parse with an independent reader; a bad folder "
    "is refused at start",
    "[coordinator]") {
  const std::string dir =
      (fs::temp_directory_path() / ("lorastream-tb-" + std::to_string(getpid()))).string();
  fs::remove_all(dir);
  {
    TensorBoardWriter writer(dir + "/logs");
    JobSummary job;
    job.id = 7;
    job.name = "demo";
    for (int64_t step = 1; step <= 3; ++step) {
      StepStats s;
      s.step = step;
      s.loss = 4.0 - static_cast<double>(step);
      s.learning_rate = 1e-3;
      s.h2d_bytes = 4000000000;
      s.h2d_busy_seconds = 2.0;
      s.peak_device_bytes = 3ull << 30;
      if (step == 2) s.eval_loss = 0.75;
      writer.Write(job, s);
    }
  }
  int code = -1;
  nlohmann::json runs = ReadEvents(dir + "/logs", &code)["runs"];
  REQUIRE(code == 0);
  REQUIRE(runs.contains("job-7-demo"));
  const nlohmann::json& run = runs["job-7-demo"];
  CHECK(run["file_version"] == "brain.Event:2");
  CHECK(run["records"] == 4);
  CHECK(run["scalars"]["train/loss"] == nlohmann::json::parse("[[1, 3.0], [2, 2.0], [3, 1.0]]"));
  CHECK(run["scalars"]["eval/loss"] == nlohmann::json::parse("[[2, 0.75]]"));
  CHECK(run["scalars"]["perf/h2d_gb_per_s"][0][1] == 2.0);
  CHECK(run["scalars"]["perf/peak_memory_gib"][0][1] == 3.0);
  for (const char* tag :
       {"train/learning_rate", "train/grad_norm", "perf/tokens_per_second", "perf/stall_seconds"})
    CHECK(run["scalars"][tag].size() == 3);

  // The reader is not a rubber stamp: one flipped bit in a record is reported.
  std::string file;
  for (const auto& entry : fs::directory_iterator(dir + "/logs/job-7-demo")) file = entry.path();
  std::string bytes = ReadAll(file);
  bytes[bytes.size() - 6] ^= 0x01;
  fs::create_directories(dir + "/bad/run");
  std::ofstream(dir + "/bad/run/events.out.tfevents.0.x", std::ios::binary) << bytes;
  ReadEvents(dir + "/bad", &code);
  CHECK(code == 1);
  CHECK_THAT(ReadAll(dir + "/bad.reader.stderr"), Catch::Contains("data CRC mismatch"));

  // A folder that cannot be made or written is refused, naming it.
  std::ofstream(dir + "/a-file") << "x";
  CHECK_THROWS_WITH(TensorBoardWriter(dir + "/a-file/sub"), Catch::Contains(dir + "/a-file/sub"));
  CHECK_THROWS_AS(TensorBoardWriter(dir + "/a-file"), Error);
  fs::remove_all(dir);
}

TEST_CASE("cluster: `coordinator --tensorboard` writes one run per job as statistics arrive",
          "[coordinator][cluster]") {
  Cluster c("tensorboard");
  const std::string logdir = (c.dir() / "tb").string();
  c.StartCoordinator({"--tensorboard", logdir});
  c.StartWorker("hosta", {"tiny:"}, 5);
  fs::path job = c.dir() / "ev.toml";
  std::ofstream(job) << "name = \"eval job\"\n[model]\nstore = \"tiny\"\n[data]\npath = \""
                     << (c.dir() / "data.jsonl").string()
                     << "\"\n[train]\nsteps = 6\noutput_dir = \"" << (c.dir() / "out-ev").string()
                     << "\"\n[eval]\nsplit = 0.5\nevery = 3\n";
  int64_t id = c.Submit(job.string());
  int64_t plain = c.Submit(c.WriteJob("plain", 4));
  REQUIRE(c.WaitState(plain, JobState::kSucceeded, 30));
  REQUIRE(c.WaitState(id, JobState::kSucceeded, 30));

  int code = -1;
  nlohmann::json runs = ReadEvents(logdir, &code)["runs"];
  REQUIRE(code == 0);
  const std::string ev = "job-" + std::to_string(id) + "-eval_job";
  const std::string pl = "job-" + std::to_string(plain) + "-plain";
  REQUIRE(runs.contains(ev));
  REQUIRE(runs.contains(pl));
  CHECK(runs[ev]["scalars"]["train/loss"].size() == 6);
  CHECK(runs[ev]["scalars"]["train/loss"][5][0] == 6);  // step = optimizer step
  CHECK(runs[ev]["scalars"]["eval/loss"] == nlohmann::json::parse("[[3, 6.666666507720947], "
                                                                  "[6, 3.3333332538604736]]"));
  CHECK(runs[pl]["scalars"]["train/loss"].size() == 4);
  CHECK_FALSE(runs[pl]["scalars"].contains("eval/loss"));

  // The same evaluations through show, stats and the plain watch line.
  std::string shown = c.Cli({"show", std::to_string(id)}, &code);
  CHECK(code == 0);
  CHECK_THAT(shown, Catch::Contains("eval loss:   3.3333 at step 6 (lowest 3.3333 at step 6)"));
  std::string csv = c.Cli({"stats", std::to_string(id), "--format", "csv"}, &code);
  CHECK_THAT(csv, Catch::Contains("\n3,6,3.33333333,"));
  CHECK_THAT(csv, Catch::Contains(",6.66666667,64\n"));
  // The checkpoint with the lowest eval loss among those kept is named by show.
  fs::create_directories(c.dir() / "out-ev");
  lorastream::testing::WriteTestCheckpoint(c.dir() / "out-ev", 3, 2.5);
  lorastream::testing::WriteTestCheckpoint(c.dir() / "out-ev", 6, 3.5);
  shown = c.Cli({"show", std::to_string(id), "--json"}, &code);
  CHECK(nlohmann::json::parse(shown)["best_checkpoint"] ==
        (c.dir() / "out-ev" / "checkpoint-3").string());

  // A folder it cannot write: the coordinator refuses to start (exit 2), naming it.
  std::ofstream(c.dir() / "file") << "x";
  std::string bad_out = RunAndCapture(
      {Bin("lorastream"), "coordinator", "--bind", "ipc://" + (c.dir() / "other.sock").string(),
       "--db", (c.dir() / "other.db").string(), "--tensorboard",
       (c.dir() / "file" / "tb").string()},
      &code, 30, (c.dir() / "bad.stderr").string());
  CHECK(code == 2);
  CHECK_THAT(ReadAll((c.dir() / "bad.stderr").string()),
             Catch::Contains((c.dir() / "file" / "tb").string()));
}
