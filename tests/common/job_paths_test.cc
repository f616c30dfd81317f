// Relative paths inside a job file resolve against the job file's own folder; the job file's
// path itself is relative to the current directory.
#include <filesystem>
#include <fstream>
#include <string>

#include <catch2/catch.hpp>

#include "common/job/job_paths.h"
#include "tests/support/test_support.h"

namespace fs = std::filesystem;
using lorastream::JobSpec;

namespace {

// Runs `body` with the current directory set to `dir`, restoring it afterwards.
template <class F>
void InDirectory(const fs::path& dir, F body) {
  const fs::path before = fs::current_path();
  fs::current_path(dir);
  try {
    body();
  } catch (...) {
    fs::current_path(before);
    throw;
  }
  fs::current_path(before);
}

struct JobTree {
  lorastream::testing::TempDir tmp{"jobpaths"};
  fs::path root = tmp.path();
  JobTree() {
    fs::create_directories(root / "project/jobs");
    fs::create_directories(root / "project/data");
    fs::create_directories(root / "elsewhere");
    std::ofstream(root / "project/data/train.jsonl") << "{\"input_ids\": [1, 2, 3]}\n";
    std::ofstream(root / "project/jobs/job.toml")
        << "[model]\nstore = \"s\"\n[data]\npath = \"../data/train.jsonl\"\n"
           "[train]\nsteps = 1\noutput_dir = \"out\"\nstats_file = \"/abs/stats.jsonl\"\n";
  }
};

}  // namespace

TEST_CASE("job file paths resolve against the job file's folder, not the current one", "[common]") {
  JobTree t;
  const fs::path project = fs::canonical(t.root / "project");
  // Loaded from a folder that is neither the job's nor the data's, through a relative path.
  InDirectory(t.root / "elsewhere", [&] {
    JobSpec spec = lorastream::LoadJobSpec("../project/jobs/job.toml");
    CHECK(spec.data.path == (project / "data/train.jsonl").string());
    CHECK(spec.train.output_dir == (project / "jobs/out").string());
    CHECK(spec.train.stats_file == "/abs/stats.jsonl");  // absolute stays as written
    CHECK(spec.data.format == "jsonl");
  });
}

TEST_CASE("ResolveJobPath: base folder for relative paths, the current one without a base",
          "[common]") {
  using lorastream::ResolveJobPath;
  CHECK(ResolveJobPath("", "/base") == "");
  CHECK(ResolveJobPath("d/x.jsonl", "/base/jobs") == "/base/jobs/d/x.jsonl");
  CHECK(ResolveJobPath("../d/x.jsonl", "/base/jobs") == "/base/d/x.jsonl");
  CHECK(ResolveJobPath("/abs/x.jsonl", "/base/jobs") == "/abs/x.jsonl");
  CHECK(ResolveJobPath("x.jsonl", "") == (fs::current_path() / "x.jsonl").string());
  CHECK(lorastream::JobFileDir("/a/b/job.toml") == "/a/b");
  CHECK(lorastream::JobFileDir("job.toml") == fs::current_path().string());
}
