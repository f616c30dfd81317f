// Trust model helpers (docs/TRUST.md): the permission walk a worker makes as a job's
// submitter, canonical paths, opening files as the submitter, the output folder's lock and
// its takeover, and the memory limit.
#include "common/posix/user_access.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include <catch2/catch.hpp>

#include "common/base/error.h"
#include "common/job/job_access.h"
#include "common/posix/acting_as.h"
#include "common/posix/file_lock.h"
#include "common/posix/memory_limit.h"
#include "common/posix/remove_tree.h"

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

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
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
  // Every path the job reads: its eval data, and each file of a model folder with what its
  // links resolve to (a weights file linked to a root-only file).
  spec.data.path = my_file;
  spec.eval.path = secret_file;
  CHECK_THROWS_WITH(CheckJobPathsAs(spec, who), Catch::Contains("`eval.path` (" + secret_file));
  spec.eval.path.clear();
  const std::string model = box.Make("mine/model", 0755, true, who.uid, who.gid);
  box.Make("mine/model/config.json", 0644, false, who.uid, who.gid);
  spec.model.checkpoint = model;
  CHECK_NOTHROW(CheckJobPathsAs(spec, who));
  fs::create_symlink(secret_file, model + "/model.safetensors");
  CHECK_THROWS_WITH(CheckJobPathsAs(spec, who),
                    Catch::Contains("`model.checkpoint` (" + model + "/model.safetensors)") &&
                        Catch::Contains("no permission to search " + box.dir + "/secret"));

  // A FLUX job's paths under their [flux] keys: its caches (each file), checkpoint and output.
  JobSpec flux;
  flux.source = "flux.toml";
  flux.is_flux = true;
  flux.flux.cache_dir = box.Make("mine/cache", 0755, true, who.uid, who.gid);
  box.Make("mine/cache/cat_0032x0032_flux.npz", 0644, false, who.uid, who.gid);
  flux.flux.output_dir = box.dir + "/mine/flux-out";
  flux.flux.store = "flux";
  CHECK_NOTHROW(CheckJobPathsAs(flux, who));
  fs::create_symlink(secret_file, flux.flux.cache_dir + "/cat_flux_te.npz");
  CHECK_THROWS_WITH(CheckJobPathsAs(flux, who),
                    Catch::Contains("flux.toml: key `flux.cache_dir` (" + flux.flux.cache_dir +
                                    "/cat_flux_te.npz)") &&
                        Catch::Contains("stranger (uid 54321)"));
  fs::remove(flux.flux.cache_dir + "/cat_flux_te.npz");
  flux.flux.store.clear();
  flux.flux.checkpoint = secret_file;
  flux.model.checkpoint = secret_file;  // mirrored, as ParseJobSpec does
  CHECK_THROWS_WITH(CheckJobPathsAs(flux, who),
                    Catch::Contains("key `flux.checkpoint` (" + secret_file + ")"));
  // Written in the shared form: the keys there ([model], [train]); the caches stay in [flux].
  flux.flux.shared_form = true;
  CHECK_THROWS_WITH(CheckJobPathsAs(flux, who),
                    Catch::Contains("flux.toml: key `model.checkpoint` (" + secret_file + ")"));
  flux.flux.checkpoint.clear();
  flux.model.checkpoint.clear();
  flux.flux.store = "flux";
  flux.flux.output_dir = box.dir + "/secret/flux-out";
  flux.model.store = "flux";
  CHECK_THROWS_WITH(
      CheckJobPathsAs(flux, who),
      Catch::Contains("flux.toml: key `train.output_dir` (" + flux.flux.output_dir + ")"));
  flux.flux.shared_form = false;
  CHECK_THROWS_WITH(
      CheckJobPathsAs(flux, who),
      Catch::Contains("flux.toml: key `flux.output_dir` (" + flux.flux.output_dir + ")"));

  // A Qwen-Image job's caches (the folder and each file in it) under `qwen_image.cache_dir`,
  // its single-file checkpoint under `model.checkpoint`.
  JobSpec qwen;
  qwen.source = "qwen.toml";
  qwen.is_qwen_image = true;
  qwen.qwen_image.cache_dir = box.Make("mine/qcache", 0755, true, who.uid, who.gid);
  box.Make("mine/qcache/cat_1024x1024_qi.safetensors", 0644, false, who.uid, who.gid);
  qwen.model.checkpoint =
      box.Make("mine/qwen_image_bf16.safetensors", 0644, false, who.uid, who.gid);
  qwen.train.output_dir = box.dir + "/mine/qwen-out";
  CHECK_NOTHROW(CheckJobPathsAs(qwen, who));
  fs::create_symlink(secret_file, qwen.qwen_image.cache_dir + "/cat_qi_te.safetensors");
  CHECK_THROWS_WITH(CheckJobPathsAs(qwen, who),
                    Catch::Contains("qwen.toml: key `qwen_image.cache_dir` (" +
                                    qwen.qwen_image.cache_dir + "/cat_qi_te.safetensors)") &&
                        Catch::Contains("stranger (uid 54321)"));
  fs::remove(qwen.qwen_image.cache_dir + "/cat_qi_te.safetensors");
  const std::string root_cache = box.Make("secret/qcache", 0755, true);
  qwen.qwen_image.cache_dir = root_cache;  // behind root's 0700 folder
  CHECK_THROWS_WITH(CheckJobPathsAs(qwen, who),
                    Catch::Contains("key `qwen_image.cache_dir` (" + root_cache + ")"));
  qwen.qwen_image.cache_dir = box.dir + "/mine/qcache";
  qwen.model.checkpoint = secret_file;
  CHECK_THROWS_WITH(CheckJobPathsAs(qwen, who),
                    Catch::Contains("key `model.checkpoint` (" + secret_file + ")"));
}

TEST_CASE("ActingAs: this thread opens and creates as the user; links lead only where it may go",
          "[common]") {
  if (::geteuid() != 0) {
    WARN("skipped: acting as another user needs root");
    return;
  }
  Sandbox box("acting");
  const UserIdentity who = Stranger();
  const std::string out = box.Make("out", 0755, true, who.uid, who.gid);
  const std::string secret = box.Make("secret.txt", 0600, false);      // root's, 0600
  const std::string readable = box.Make("readable.txt", 0644, false);  // root's, 0644
  // Placed by the user before the job: a root file moved into its folder, a hard link to a
  // root file, a symbolic link to one.
  const std::string moved = box.Make("out/moved.txt", 0644, false);
  REQUIRE(::link(secret.c_str(), (out + "/hard").c_str()) == 0);
  fs::create_symlink(secret, out + "/stats.jsonl");
  auto owner = [](const std::string& p) {
    struct stat st {};
    REQUIRE(::lstat(p.c_str(), &st) == 0);
    return st.st_uid;
  };
  auto can_open = [](const std::string& p, int flags) {
    int fd = ::open(p.c_str(), flags | O_CLOEXEC, 0644);
    if (fd >= 0) ::close(fd);
    return fd >= 0;
  };
  std::atomic<int> phase{0};
  bool other_thread_root = false;
  std::thread job([&] {
    {
      ActingAs as(&who);
      CHECK(as.active());
      CHECK(can_open(out + "/new.txt", O_WRONLY | O_CREAT));  // created as the user
      CHECK_FALSE(can_open(out + "/hard", O_WRONLY | O_APPEND));
      CHECK_FALSE(can_open(out + "/stats.jsonl", O_WRONLY | O_APPEND));
      CHECK_FALSE(can_open(secret, O_RDONLY));
      CHECK(can_open(readable, O_RDONLY));
      CHECK_FALSE(can_open(box.dir + "/root-new.txt", O_WRONLY | O_CREAT));  // root's folder
      // Placed during the job: a link swapped in is checked when it is opened.
      fs::remove(out + "/new.txt");
      CHECK(::symlink(secret.c_str(), (out + "/new.txt").c_str()) == 0);
      CHECK_FALSE(can_open(out + "/new.txt", O_WRONLY | O_APPEND));
      phase = 1;  // the process's other threads keep their own identity meanwhile
      while (phase != 2) std::this_thread::yield();
    }
    CHECK(can_open(secret, O_RDONLY));  // back to root
  });
  while (phase != 1) std::this_thread::yield();
  other_thread_root = can_open(secret, O_RDONLY);
  phase = 2;
  job.join();
  CHECK(other_thread_root);
  // Nothing the user did not own changed owner; what was created is the user's.
  CHECK(owner(moved) == 0u);
  CHECK(owner(secret) == 0u);
  CHECK(owner(out + "/hard") == 0u);
  CHECK(ReadAll(secret) == "x");
  // A process that is not root cannot act as someone else; nullptr or itself changes nothing.
  CHECK_FALSE(ActingAs(nullptr).active());
  UserIdentity self;
  self.uid = ::geteuid();
  CHECK_FALSE(ActingAs(&self).active());
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

TEST_CASE(
    "OutputDirLock: a later attempt of the same job takes the folder over and fences the "
    "older one; anyone else is refused",
    "[common]") {
  Sandbox box("takeover");
  const std::string dir = box.dir;
  OutputDirLock first = OutputDirLock::Acquire(dir, AttemptHolder(7, 1, "pid 11"));
  CHECK(first.locked());
  CHECK(first.StillOwned());
  // Another job, the same attempt again, an older attempt, a standalone run: refused.
  for (const std::string& other : {AttemptHolder(8, 2, "pid 12"), AttemptHolder(7, 1, "pid 13"),
                                   std::string("lorastream-worker pid 14")}) {
    INFO(other);
    CHECK_THROWS_WITH(OutputDirLock::Acquire(dir, other),
                      Catch::Contains("train.output_dir " + dir +
                                      " is in use by job 7 attempt 1 "
                                      "(pid 11)"));
  }
  CHECK(first.StillOwned());
  // Attempt 2 (the coordinator declared attempt 1 dead): takes it over while 1 still holds
  // the flock; attempt 1 is fenced at its next write.
  OutputDirLock second = OutputDirLock::Acquire(dir, AttemptHolder(7, 2, "pid 15"));
  CHECK_FALSE(second.locked());
  CHECK(second.StillOwned());
  CHECK_FALSE(first.StillOwned());
  CHECK_THROWS_WITH(first.RequireOwned(), Catch::Contains("was taken over by job 7 attempt 2"));
  CHECK_THROWS_WITH(OutputDirLock::Acquire(dir, AttemptHolder(7, 1, "pid 16")),
                    Catch::Contains("in use by job 7 attempt 2"));
  // Attempt 1 lets go: attempt 2 holds the lock from its next check on.
  { OutputDirLock gone = std::move(first); }
  CHECK(second.StillOwned());
  CHECK(second.locked());
}

TEST_CASE("MemoryLimitProblem names the estimate and the limit", "[common]") {
  CHECK(MemoryLimitProblem(1 << 20, 2 << 20, "cuda:0").empty());
  CHECK(MemoryLimitProblem(1 << 20, 0, "cpu").empty());  // unknown limit: no refusal
  CHECK_THAT(MemoryLimitProblem(uint64_t{35} << 40, uint64_t{16} << 30, "the host's memory (cpu)"),
             Catch::Contains("estimated peak memory, 35.0 TiB") &&
                 Catch::Contains("exceeds the 16.0 GiB of the host's memory (cpu)") &&
                 Catch::Contains("train.batch_size"));
  CHECK(HostMemoryBytes() > (uint64_t{64} << 20));
}
