// Trust model helpers (README: Trust model): the permission walk a worker makes as a job's
// submitter, canonical paths, handing files over, and the exclusive file lock.
#include "common/user_access.h"

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include <catch2/catch.hpp>

#include "common/error.h"
#include "common/file_lock.h"
#include "common/job_access.h"
#include "common/remove_tree.h"

using namespace lorastream;
namespace fs = std::filesystem;

namespace {

// A folder under /tmp removed at the end (searchable by everyone, like /tmp itself).
struct Sandbox {
  std::string dir;
  explicit Sandbox(const std::string& tag) {
    dir = CanonicalPath(
        (fs::temp_directory_path() / ("lorastream-" + tag + "-" + std::to_string(getpid())))
            .string());
    RemoveTree(dir);
    fs::create_directories(dir);
    ::chmod(dir.c_str(), 0755);
  }
  ~Sandbox() { RemoveTree(dir); }
  std::string Make(const std::string& rel, mode_t mode, bool folder, uid_t uid = 0,
                   gid_t gid = 0) const {
    std::string path = dir + "/" + rel;
    if (folder)
      fs::create_directories(path);
    else
      std::ofstream(path) << "x";
    REQUIRE(::chmod(path.c_str(), mode) == 0);
    if (::geteuid() == 0) REQUIRE(::chown(path.c_str(), uid, gid) == 0);
    return path;
  }
};

// A user who is neither root nor the owner of anything here (needs no account: the walk
// reads only mode bits and ids).
UserIdentity Stranger() {
  UserIdentity who;
  who.uid = 54321;
  who.gid = 54321;
  who.groups = {54321, 54322};
  who.name = "stranger";
  return who;
}

}  // namespace

TEST_CASE("CanonicalPath: one folder, however spelled; missing tails resolved lexically",
          "[common]") {
  Sandbox box("canon");
  const std::string dd = box.dir + "/x/dd";
  fs::create_directories(dd);
  fs::create_directory_symlink(dd, box.dir + "/link");
  CHECK(CanonicalPath(dd) == dd);
  CHECK(CanonicalPath(dd + "/") == dd);
  CHECK(CanonicalPath(box.dir + "/x/./dd") == dd);
  CHECK(CanonicalPath(box.dir + "/x//dd//") == dd);
  CHECK(CanonicalPath(box.dir + "/link") == dd);
  CHECK(CanonicalPath(box.dir + "/link/") == dd);
  CHECK(CanonicalPath(box.dir + "/x/missing/../dd") == dd);
  // Not existing yet: the existing prefix through the link, the rest as written.
  CHECK(CanonicalPath(box.dir + "/link/new/") == dd + "/new");
  CHECK(CanonicalPath(box.dir + "/link/new/./a/../b") == dd + "/new/b");
  char cwd[4096];
  REQUIRE(::getcwd(cwd, sizeof(cwd)) != nullptr);
  REQUIRE(::chdir(box.dir.c_str()) == 0);
  CHECK(CanonicalPath("x/dd") == dd);
  REQUIRE(::chdir(cwd) == 0);
}

TEST_CASE("AccessProblem walks every component with the user's ids and groups", "[common]") {
  if (::geteuid() != 0) {
    WARN("skipped: the files of this test must belong to root");
    return;
  }
  Sandbox box("access");
  const UserIdentity who = Stranger();
  box.Make("secret", 0700, true);
  const std::string secret_file = box.Make("secret/data.jsonl", 0600, false);
  box.Make("open", 0755, true);
  const std::string open_file = box.Make("open/data.jsonl", 0644, false);
  box.Make("mine", 0700, true, who.uid, who.gid);
  const std::string my_file = box.Make("mine/data.jsonl", 0600, false, who.uid, who.gid);
  box.Make("team", 0770, true, 0, 54322);  // a supplementary group of the user
  box.Make("others", 0770, true, 0, 600);  // a group the user is not in
  fs::create_symlink(secret_file, box.dir + "/mine/link");

  // Reading: a folder on the way without search permission; a file without read permission.
  std::string why = AccessProblem(secret_file, who, PathAccess::kRead);
  CHECK_THAT(why, Catch::Contains("no permission to search " + box.dir + "/secret") &&
                      Catch::Contains("mode 0700"));
  CHECK(AccessProblem(open_file, who, PathAccess::kRead).empty());
  CHECK(AccessProblem(my_file, who, PathAccess::kRead).empty());
  // A link of the user's to a file it may not read leads nowhere.
  CHECK_FALSE(AccessProblem(box.dir + "/mine/link", who, PathAccess::kRead).empty());
  // Writing: an existing file it may only read; a new file in a folder it may not write.
  CHECK_THAT(AccessProblem(open_file, who, PathAccess::kWrite),
             Catch::Contains("no permission to write " + open_file));
  CHECK_THAT(AccessProblem(box.dir + "/open/new/sub/stats.jsonl", who, PathAccess::kWrite),
             Catch::Contains("no permission to create files in " + box.dir + "/open"));
  CHECK(AccessProblem(box.dir + "/mine/new/sub", who, PathAccess::kWrite).empty());
  CHECK(AccessProblem(box.dir + "/team/out", who, PathAccess::kWrite).empty());
  CHECK_FALSE(AccessProblem(box.dir + "/others/out", who, PathAccess::kWrite).empty());
  CHECK_THAT(AccessProblem(open_file + "/below", who, PathAccess::kWrite),
             Catch::Contains("is not a folder"));
  // Root may do everything; the owner of a file may use it.
  UserIdentity root;
  CHECK(AccessProblem(secret_file, root, PathAccess::kWrite).empty());

  // The job-level check names the key, the path and the user.
  JobSpec spec;
  spec.source = "job.toml";
  spec.data.path = my_file;
  spec.train.output_dir = box.dir + "/mine/out";
  CHECK_NOTHROW(CheckJobPathsAs(spec, who));
  spec.train.stats_file = "/etc/lorastream-stats.jsonl";
  CHECK_THROWS_WITH(CheckJobPathsAs(spec, who), Catch::Contains("`train.stats_file`") &&
                                                    Catch::Contains("stranger (uid 54321)") &&
                                                    Catch::Contains("/etc"));
  spec.train.stats_file.clear();
  spec.data.path = secret_file;
  try {
    CheckJobPathsAs(spec, who);
    FAIL("a root-only data file passed");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kRefused);
    CHECK_THAT(e.what(), Catch::Contains("`data.path` (" + secret_file + ")"));
  }
}

TEST_CASE("ChownTreeOwnedByUs hands over what we wrote and never follows a link", "[common]") {
  if (::geteuid() != 0) {
    WARN("skipped: changing owners needs root");
    return;
  }
  Sandbox box("chown");
  const std::string outside = box.Make("outside.txt", 0644, false);
  const std::string out = box.Make("out", 0755, true);
  box.Make("out/checkpoint-2", 0755, true);
  const std::string deep = box.Make("out/checkpoint-2/adapter.bin", 0644, false);
  const std::string theirs = box.Make("out/theirs.txt", 0644, false, 777, 777);
  fs::create_symlink(outside, out + "/link");
  std::string error;
  CHECK(ChownTreeOwnedByUs(out, 54321, 54321, &error));
  CHECK(error.empty());
  struct stat st {};
  for (const std::string& p : {out, out + "/checkpoint-2", deep}) {
    REQUIRE(::lstat(p.c_str(), &st) == 0);
    CHECK(st.st_uid == 54321u);
  }
  REQUIRE(::lstat(theirs.c_str(), &st) == 0);
  CHECK(st.st_uid == 777u);  // not ours: left alone
  REQUIRE(::stat(outside.c_str(), &st) == 0);
  CHECK(st.st_uid == 0u);  // behind the link: untouched
  // A folder on the way replaced by a link (to a root-owned tree) stops the walk.
  const std::string tree = box.Make("tree", 0755, true);
  const std::string inside = box.Make("tree/file", 0644, false);
  fs::create_directory_symlink(tree, box.dir + "/swapped");
  error.clear();
  CHECK_FALSE(ChownTreeOwnedByUs(box.dir + "/swapped/file", 54321, 54321, &error));
  CHECK_THAT(error, Catch::Contains("never followed"));
  ChownTreeOwnedByUs(box.dir + "/swapped/", 54321, 54321, &error);  // only the link itself
  REQUIRE(::stat(inside.c_str(), &st) == 0);
  CHECK(st.st_uid == 0u);
  REQUIRE(::stat(tree.c_str(), &st) == 0);
  CHECK(st.st_uid == 0u);
  CHECK(ChownTreeOwnedByUs(box.dir + "/missing/x", 54321, 54321, &error));
}

TEST_CASE("FileLock: one holder at a time, the refusal names it, released on destruction",
          "[common]") {
  Sandbox box("lock");
  const std::string path = box.dir + "/x.lock";
  {
    FileLock first = FileLock::Acquire(path, "job 7 attempt 1 (pid 42)", "train.output_dir /x");
    CHECK(first.held());
    try {
      FileLock::Acquire(path, "job 8", "train.output_dir /x");
      FAIL("a second holder got the lock");
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::kRefused);
      CHECK_THAT(e.what(), Catch::Contains("train.output_dir /x is in use by job 7 attempt 1 "
                                           "(pid 42)"));
    }
    struct stat st {};
    REQUIRE(::stat(path.c_str(), &st) == 0);
    CHECK((st.st_mode & 0777) == 0600);
  }
  CHECK(FileLock::Acquire(path, "job 8", "train.output_dir /x").held());
  // Never through a link planted in its place.
  fs::create_symlink(box.dir + "/elsewhere", box.dir + "/link.lock");
  CHECK_THROWS_AS(FileLock::Acquire(box.dir + "/link.lock", "job 9", "x"), Error);
  CHECK_FALSE(fs::exists(box.dir + "/elsewhere"));
}

TEST_CASE("FirstMissingAncestor names the top folder a job would create", "[common]") {
  Sandbox box("missing");
  CHECK(FirstMissingAncestor(box.dir) == box.dir);
  CHECK(FirstMissingAncestor(box.dir + "/a/b/c") == box.dir + "/a");
}
