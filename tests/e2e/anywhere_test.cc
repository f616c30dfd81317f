// `lorastream up` works from any folder, in the build tree and installed by `cmake --install`,
// and a CPU-only build refuses CUDA workers in one line before it starts anything.

#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "common/posix/subprocess.h"
#include "coordinator/client/build_info.h"
#include "tests/support/test_support.h"

namespace fs = std::filesystem;

namespace {

// Runs argv with `cwd` as its current directory (through sh: cd, then exec).
std::string RunIn(const fs::path& cwd, std::vector<std::string> argv, int* code,
                  const std::string& stderr_path, double timeout_s = 900) {
  argv.insert(argv.begin(), {"/bin/sh", "-c", "cd \"$0\" && exec \"$@\"", cwd.string()});
  return lorastream::RunAndCapture(argv, code, timeout_s, stderr_path);
}

std::string ReadAll(const fs::path& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// `lorastream up` of the example jobs, from `cwd`, with the executable `lorastream`; checks
// every example job succeeded with its adapter under cwd/runs/up-*/adapters/.
void UpTrainsTheExamples(const fs::path& cwd, const std::string& lorastream) {
  int code = -1;
  // Two CPU workers, also on a CUDA build (the GPU path has tests of its own).
  const std::string out =
      RunIn(cwd, {lorastream, "up", "--no-watch", "--device", "cpu", "--device", "cpu"}, &code,
            (cwd / "up.stderr").string());
  INFO(out << ReadAll(cwd / "up.stderr"));
  REQUIRE(code == 0);
  std::vector<fs::path> runs;
  for (const auto& e : fs::directory_iterator(cwd / "runs")) runs.push_back(e.path());
  REQUIRE(runs.size() == 1);
  CHECK_THAT(runs[0].filename().string(), Catch::StartsWith("up-"));
  for (const char* job : {"tiny_llama", "tiny_llama_attention_streamed", "tiny_llama_mlp_rslora"}) {
    INFO(job);
    CHECK(fs::exists(runs[0] / "adapters" / job / "adapter_model.safetensors"));
    CHECK_THAT(out, Catch::Contains((runs[0] / "adapters" / job).string()));
  }
  // Three jobs, every one succeeded.
  const std::regex succeeded("succeeded  step [0-9]+/[0-9]+, ");
  CHECK(std::distance(std::sregex_iterator(out.begin(), out.end(), succeeded),
                      std::sregex_iterator()) == 3);
}

}  // namespace

TEST_CASE("`lorastream up` from a temporary folder trains the example jobs", "[e2e][anywhere]") {
  const lorastream::testing::TempDir dir("anywhere-tmpcwd");
  UpTrainsTheExamples(dir.path(), std::string(LORASTREAM_BIN_DIR) + "/lorastream");
}

TEST_CASE("installed by `cmake --install`, `lorastream up` trains the examples from any folder",
          "[e2e][anywhere]") {
  const lorastream::testing::TempDir tmp("anywhere-installed");
  const fs::path& dir = tmp.path();
  int code = -1;
  const std::string log = (dir / "install.log").string();
  lorastream::RunAndCapture({LORASTREAM_CMAKE_COMMAND, "--install", LORASTREAM_BUILD_DIR,
                             "--prefix", (dir / "prefix").string()},
                            &code, 300, log);
  INFO(ReadAll(log));
  REQUIRE(code == 0);
  for (const char* f : {"bin/lorastream", "bin/lorastream-worker", "bin/lorastream-store",
                        "bin/lorastream-synth", "share/lorastream/configs/models/tiny.toml",
                        "share/lorastream/configs/jobs/tiny_llama.toml",
                        "share/lorastream/configs/data/tiny.jsonl"})
    CHECK(fs::exists(dir / "prefix" / f));
  // The installed example jobs point no output folder inside the prefix, and cite nothing that
  // is not installed; the walk-through's tokenizer is there.
  for (const auto& e : fs::directory_iterator(dir / "prefix/share/lorastream/configs/jobs")) {
    const std::string job = ReadAll(e.path());
    INFO(e.path() << "\n" << job);
    CHECK_FALSE(std::regex_search(job, std::regex("\noutput_dir *=")));
    CHECK(job.find("common/") == std::string::npos);
  }
  CHECK(fs::exists(dir / "prefix/share/lorastream/tokenizers/llama3/tokenizer.json"));
  CHECK(fs::exists(dir / "prefix/share/doc/lorastream/README.md"));
  fs::create_directories(dir / "elsewhere");
  UpTrainsTheExamples(dir / "elsewhere", (dir / "prefix/bin/lorastream").string());
  // The README's walk-through, step 1: the bundled tokenizer by name, from another folder.
  RunIn(dir / "elsewhere",
        {(dir / "prefix/bin/lorastream-synth").string(), "--preset", "tiny", "--tokenizer",
         "llama3", "--out", "runs/walk/model"},
        &code, (dir / "synth.stderr").string(), 300);
  INFO(ReadAll(dir / "synth.stderr"));
  CHECK(code == 0);
  CHECK(fs::exists(dir / "elsewhere/runs/walk/model/tokenizer.json"));
}

TEST_CASE("every executable answers --version: version, commit, LibTorch, CUDA", "[e2e]") {
  const std::string expected_torch =
      lorastream::client::ThisBuild().libtorch_version.empty()
          ? "no LibTorch"
          : "LibTorch " + lorastream::client::ThisBuild().libtorch_version;
  for (const char* exe :
       {"lorastream", "lorastream-store", "lorastream-synth", "lorastream-worker"}) {
    int code = -1;
    const std::string out = lorastream::RunAndCapture(
        {std::string(LORASTREAM_BIN_DIR) + "/" + exe, "--version"}, &code, 60);
    INFO(exe << ": " << out);
    CHECK(code == 0);
    CHECK_THAT(
        out, Catch::StartsWith(std::string(exe) + " ") && Catch::Contains("(commit ") &&
                 Catch::Contains(expected_torch) &&
                 Catch::Contains(lorastream::client::ThisBuild().cuda ? ", CUDA " : ", CPU only"));
  }
}

TEST_CASE("a CPU-only build on a machine with GPUs refuses CUDA workers in one line",
          "[e2e][anywhere]") {
  if (lorastream::client::ThisBuild().cuda) {
    WARN("a CUDA build: nothing to refuse");
    return;
  }
  const lorastream::testing::TempDir tmp("anywhere-refuse");
  const fs::path& dir = tmp.path();
  // Two GPUs as the driver's /proc folder shows them.
  fs::create_directories(dir / "gpus/0000:19:00.0");
  fs::create_directories(dir / "gpus/0000:3b:00.0");
  const std::string env = "LORASTREAM_NVIDIA_GPUS_DIR=" + (dir / "gpus").string();
  const std::string bin = LORASTREAM_BIN_DIR;
  std::ofstream(dir / "job.toml") << "[model]\nstore = \"s\"\n[data]\npath = \"d.jsonl\"\n"
                                     "[train]\nsteps = 1\noutput_dir = \"out\"\n";
  struct Case {
    std::vector<std::string> argv;
    std::string device;
  };
  const std::vector<Case> cases = {
      {{bin + "/lorastream", "up", "--no-watch", "--run-dir", (dir / "run").string()},
       "cuda:0, cuda:1"},
      {{bin + "/lorastream", "up", "--no-watch", "--device", "cuda:1", "--run-dir",
        (dir / "run").string()},
       "cuda:1"},
      {{bin + "/lorastream-worker", "serve", "--coordinator", "tcp://127.0.0.1:9", "--device",
        "cuda:0"},
       "cuda:0"},
      {{bin + "/lorastream-worker", "train", (dir / "job.toml").string(), "--device", "cuda:1"},
       "cuda:1"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    std::vector<std::string> argv = {"/usr/bin/env", env};
    argv.insert(argv.end(), c.argv.begin(), c.argv.end());
    int code = -1;
    const fs::path err_path = dir / ("err-" + std::to_string(i));  // appended to: one per run
    const std::string out = lorastream::RunAndCapture(argv, &code, 60, err_path.string());
    const std::string err = ReadAll(err_path);
    INFO(c.argv[0] << " " << c.argv[1] << ": " << out << err);
    CHECK(code == 5);  // refused: what this build cannot do (kUnsupported)
    CHECK(out.empty());
    CHECK(std::count(err.begin(), err.end(), '\n') == 1);  // one line
    CHECK_THAT(err, Catch::Contains("this build is CPU-only") &&
                        Catch::Contains("cannot use " + c.device) &&
                        Catch::Contains("this machine has 2 NVIDIA GPU(s)") &&
                        Catch::Contains("rebuild for CUDA with `tools/setup.sh`"));
    CHECK(!fs::exists(dir / "run"));  // nothing started
    CHECK(!fs::exists(dir / "out"));
  }
  // CPU workers on the same machine are not refused.
  int code = -1;
  lorastream::RunAndCapture({"/usr/bin/env", env, bin + "/lorastream-worker", "train",
                             (dir / "job.toml").string(), "--device", "cpu"},
                            &code, 60, (dir / "err-cpu").string());
  CHECK_THAT(ReadAll(dir / "err-cpu"), !Catch::Contains("CPU-only"));
  // `train` without --device on this CPU-only build trains on the CPU, and warns that the
  // machine has GPUs it cannot use.
  lorastream::RunAndCapture(
      {"/usr/bin/env", env, bin + "/lorastream-worker", "train", (dir / "job.toml").string()},
      &code, 60, (dir / "err-default").string());
  CHECK_THAT(ReadAll(dir / "err-default"),
             Catch::Contains("training on the CPU although this machine has 2 NVIDIA GPU(s)") &&
                 Catch::Contains("rebuild for CUDA with `tools/setup.sh`"));
}
