#include "common/posix/remove_tree.h"

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include <catch2/catch.hpp>

#include "tests/support/test_support.h"

using namespace lorastream;
namespace fs = std::filesystem;

TEST_CASE("RemoveTree removes nested trees, never follows links, accepts a missing path",
          "[common]") {
  const testing::TempDir scratch("rmtree");
  const fs::path root = scratch.path() / "tree";
  const fs::path outside = scratch.path() / "outside";
  fs::create_directories(root / "a" / "b" / "c");
  fs::create_directories(outside);
  std::ofstream(outside / "keep.txt") << "keep";
  std::ofstream(root / "top.txt") << "x";
  std::ofstream(root / "a" / "b" / "c" / "deep.bin") << "y";
  fs::create_directories(root / "a" / "empty");
  fs::create_directory_symlink(outside, root / "a" / "link-to-outside");
  fs::create_symlink(root / "nowhere", root / "dangling");

  std::string error;
  CHECK(RemoveTree(root.string(), &error));
  CHECK(error.empty());
  CHECK(!fs::exists(fs::symlink_status(root)));
  CHECK(fs::exists(outside / "keep.txt"));  // the link was removed, not followed

  CHECK(RemoveTree(root.string()));  // already gone: not an error
  std::ofstream(root.string() + ".file") << "z";
  CHECK(RemoveTree(root.string() + ".file"));  // a plain file
  CHECK(!fs::exists(root.string() + ".file"));

  if (geteuid() != 0) {  // root ignores permissions
    fs::create_directories(root / "locked");
    std::ofstream(root / "locked" / "f") << "f";
    chmod((root / "locked").c_str(), 0500);
    CHECK_FALSE(RemoveTree(root.string(), &error));
    CHECK_THAT(error, Catch::Contains("locked"));
    chmod((root / "locked").c_str(), 0700);
  }
  CHECK(RemoveTree(root.string()));
  CHECK(RemoveTree(outside.string()));
  CHECK(!fs::exists(outside));
}
