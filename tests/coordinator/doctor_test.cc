// `lorastream doctor`: the report's fields on this machine, a problem (no coordinator) named
// with its fix, a reachable coordinator counted; and the CPU-build refusal line.
#include <sys/statvfs.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <sstream>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "cluster_fixture.h"
#include "common/posix/gpu_info.h"
#include "coordinator/cli/doctor.h"
#include "coordinator/client/build_info.h"
#include "store/server.h"
#include "store/shm_segment.h"
#include "store/synth.h"

using namespace lorastream;
using namespace lorastream::client;
using namespace lorastream::cli;
using lorastream::testing::Cluster;

namespace {

const nlohmann::json* FindProblem(const nlohmann::json& report, const std::string& check) {
  for (const auto& p : report["problems"])
    if (p.value("check", "") == check) return &p;
  return nullptr;
}

}  // namespace

TEST_CASE("doctor --json reports this machine and an unreachable coordinator with its fix",
          "[coordinator][doctor]") {
  Cluster c("doctor-none");  // a folder; no coordinator is started on its endpoint
  int code = -1;
  std::string out = c.Cli({"doctor", "--json", "--timeout", "0.5"}, &code);
  INFO(out);
  CHECK(code == 1);  // at least the coordinator is a problem
  nlohmann::json r = nlohmann::json::parse(out);

  CHECK(r["build"]["cuda"].get<bool>() == ThisBuild().cuda);
  CHECK(r["build"]["summary"] == BuildSummary());
  // A build without the worker (the sanitizer builds) has no LibTorch to name.
  CHECK(r["build"]["libtorch_version"] == ThisBuild().libtorch_version);
  CHECK(r["gpus"].is_array());
  CHECK(r["gpus"].size() == ListGpus().size());
  CHECK(r["memlock"]["unlimited"].is_boolean());

  struct statvfs st {};
  REQUIRE(statvfs("/dev/shm", &st) == 0);
  CHECK(r["dev_shm"]["size_bytes"].get<uint64_t>() == uint64_t(st.f_blocks) * st.f_frsize);
  CHECK(r["dev_shm"]["free_bytes"].get<uint64_t>() <= r["dev_shm"]["size_bytes"].get<uint64_t>());
  CHECK(r["shmem_huge_pages"].contains("setting"));
  if (!ThisBuild().cuda) {
    CHECK(r["host_register"]["applicable"] == false);
    CHECK(r["host_register"]["detail"] == "not applicable: CPU build");
  }
  CHECK(r["stores"].is_array());

  CHECK(r["coordinator"]["endpoint"] == c.endpoint());
  CHECK(r["coordinator"]["reachable"] == false);
  const nlohmann::json* p = FindProblem(r, "coordinator");
  REQUIRE(p != nullptr);
  CHECK_THAT(p->value("problem", ""), Catch::Contains(c.endpoint()));
  CHECK_THAT(p->value("fix", ""), Catch::Contains("lorastream coordinator"));

  // The screen form: one line per problem, with its fix.
  std::string text = c.Cli({"doctor", "--timeout", "0.5"}, &code);
  INFO(text);
  CHECK(code == 1);
  CHECK_THAT(text, Catch::Contains("  coordinator    " + c.endpoint() + ": not reachable"));
  CHECK_THAT(text, Catch::Contains("  coordinator: no coordinator answers at " + c.endpoint() +
                                   "; fix: start one"));
  CHECK_THAT(text, Catch::Contains("  build          " + BuildSummary()));
}

TEST_CASE("doctor counts the workers of a reachable coordinator", "[coordinator][doctor]") {
  Cluster c("doctor-up");
  c.StartCoordinator();
  c.StartWorker("hostA", {"tiny:fp"});
  REQUIRE(lorastream::testing::WaitFor([&] { return c.ListWorkersAlive() == 1; }, 20));
  DoctorOptions o;
  o.endpoint = c.endpoint();
  nlohmann::json r = DoctorReport(o);
  CHECK(r["coordinator"]["reachable"] == true);
  CHECK(r["coordinator"]["workers"] == 1);
  CHECK(FindProblem(r, "coordinator") == nullptr);
}

TEST_CASE("doctor shows each store's size, format and RAM", "[coordinator][doctor]") {
  lorastream::testing::TempDir dir("doctor-store");
  store::SynthOptions synth;
  synth.preset = std::string(LORASTREAM_SOURCE_DIR) + "/configs/models/tiny-qwen2.toml";
  synth.out_dir = dir.str();
  synth.threads = 2;
  store::RunSynth(synth);
  store::ServeOptions serve;
  serve.model_dir = dir.str();
  serve.name = "doctor-fp8-" + std::to_string(::getpid());
  serve.threads = 2;
  serve.quantize = QuantMethod::kFp8;
  auto published = store::PublishedStore::Build(serve);
  uint64_t pages = 0;  // what the segments take in /dev/shm and in RAM
  for (const SegmentInfo& b : published->manifest().blocks) pages += store::RoundUpToPage(b.nbytes);
  pages += store::RoundUpToPage(published->manifest().rest.nbytes);

  Cluster c("doctor-store");  // an endpoint where no coordinator answers
  DoctorOptions o;
  o.endpoint = c.endpoint();
  o.timeout_s = 0.2;
  const nlohmann::json r = DoctorReport(o);
  const nlohmann::json* found = nullptr;
  for (const auto& s : r["stores"])
    if (s.value("name", "") == serve.name) found = &s;
  REQUIRE(found != nullptr);
  INFO(found->dump());
  CHECK((*found)["state"] == "published");
  CHECK_THAT((*found)["format"].get<std::string>(),
             Catch::EndsWith(", blocks fp8 (e4m3, 128x128 scales)"));
  const uint64_t bytes = (*found)["bytes"].get<uint64_t>();
  CHECK(bytes >= pages);  // the segments and the manifest
  CHECK(bytes <= pages + (1u << 20));
  const uint64_t pss = (*found)["pss_bytes"].get<uint64_t>();
  CHECK(pss >= pages);  // the store process (this one) prefaulted every page
  CHECK(pss <= bytes);
  CHECK_THAT(DoctorText(r), Catch::Contains(serve.name + ": published") &&
                                Catch::Contains("blocks fp8 (e4m3, 128x128 scales)") &&
                                Catch::Contains("in RAM"));
}

TEST_CASE("a CPU-only build refuses CUDA devices in one line naming the fix",
          "[coordinator][doctor]") {
  BuildInfo cpu{false, "1.13.1", "/usr/share/cmake/Torch", ""};
  BuildInfo gpu{true, "2.11.0", "/torch", "13.0"};
  CHECK(CudaBuildProblem({"cpu", "cpu"}, 2, cpu).empty());
  CHECK(CudaBuildProblem({"cuda:0"}, 2, gpu).empty());
  const std::string line = CudaBuildProblem({"cpu", "cuda:1"}, 2, cpu);
  CHECK(line.find('\n') == std::string::npos);
  CHECK_THAT(line, Catch::Contains("CPU-only (LibTorch 1.13.1, CPU only)") &&
                       Catch::Contains("cannot use cuda:1") &&
                       Catch::Contains("this machine has 2 NVIDIA GPU(s)") &&
                       Catch::Contains("`tools/setup.sh`"));
  CHECK_THAT(CudaBuildProblem({"cuda"}, 0, cpu), Catch::Contains("shows no NVIDIA GPU"));
  CHECK(BuildSummary(gpu) == "LibTorch 2.11.0, CUDA 13.0");
}

TEST_CASE("GPU detection reads the folder LORASTREAM_NVIDIA_GPUS_DIR names",
          "[coordinator][doctor]") {
  Cluster c("doctor-gpus");
  const auto gpus = c.dir() / "gpus";
  std::filesystem::create_directories(gpus / "0000:19:00.0");
  std::filesystem::create_directories(gpus / "0000:3b:00.0");
  std::ofstream(gpus / "0000:19:00.0/information") << "Model: \t\t NVIDIA H200\nIRQ: 1\n";
  setenv("LORASTREAM_NVIDIA_GPUS_DIR", gpus.c_str(), 1);
  unsetenv("CUDA_VISIBLE_DEVICES");
  const auto list = ListGpus();
  const auto visible = VisibleCudaDevices();
  setenv("CUDA_VISIBLE_DEVICES", "1", 1);
  const auto one = VisibleCudaDevices();
  unsetenv("CUDA_VISIBLE_DEVICES");
  unsetenv("LORASTREAM_NVIDIA_GPUS_DIR");
  REQUIRE(list.size() == 2);
  CHECK(list[0].name == "NVIDIA H200");
  CHECK(list[1].index == 1);
  CHECK(visible == std::vector<std::string>{"cuda:0", "cuda:1"});
  CHECK(one == std::vector<std::string>{"cuda:0"});
}

TEST_CASE("doctor: no coordinator where none was named is a note, not a problem",
          "[coordinator][doctor]") {
  Cluster c("doctor-note");  // no coordinator on its endpoint
  DoctorOptions o;
  o.endpoint = c.endpoint();
  o.timeout_s = 0.2;
  o.expect_coordinator = false;  // as `lorastream doctor` without --coordinator
  const nlohmann::json r = DoctorReport(o);
  CHECK(r["coordinator"]["reachable"] == false);
  CHECK(FindProblem(r, "coordinator") == nullptr);
  REQUIRE(r["notes"].size() == 1);
  CHECK(r["notes"][0]["check"] == "coordinator");
  CHECK_THAT(r["notes"][0].value("note", ""), Catch::Contains(c.endpoint()));
  std::ostringstream text;
  const int code = RunDoctor(o, false, text);
  INFO(text.str());
  // Healthy unless the machine itself has a problem; the missing coordinator is not one.
  CHECK(code == (DoctorReport(o)["problems"].empty() ? 0 : 1));
  CHECK_THAT(text.str(), Catch::Contains("  note: no coordinator runs at " + c.endpoint()));
}
