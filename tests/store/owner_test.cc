// Stores are trusted only when they belong to the expected user (docs/TRUST.md): a
// store another user serves is not attached, its name says who holds it, and a segment of
// another user among the store's own is refused by name. Multi-user: a temporary user.
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <thread>

#include <catch2/catch.hpp>

#include "common/base/error.h"
#include "common/posix/shm_names.h"
#include "common/posix/subprocess.h"
#include "store/attach.h"
#include "store/manifest_object.h"
#include "store/registry.h"
#include "test_util.h"
#include "tests/temp_user.h"

using namespace lorastream;
using namespace lorastream::store;
using namespace lorastream::testing;

namespace {

// Starts `argv` (a `lorastream-store serve` of store `name`, logging to `log`) and waits
// (bounded) until the store is published.
Subprocess ServeStore(const std::vector<std::string>& argv, const std::string& name,
                      const std::string& log) {
  SpawnOptions so;
  so.log_path = log;
  Subprocess store = Subprocess::Spawn(argv, so);
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (true) {
    std::optional<ManifestRecord> r = ReadManifestObject(name);
    if (r && r->state == ManifestState::kPublished) return store;
    INFO("store log " << log);
    REQUIRE(store.Running());
    REQUIRE(std::chrono::steady_clock::now() < deadline);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace

TEST_CASE("a store of another user is not attached and its name says who holds it", "[store]") {
  TempUser user("st");
  SKIP_UNLESS_ROOT(user);
  TempDir dir("store");
  REQUIRE(::chmod(dir.str().c_str(), 0755) == 0);  // the user reads the model
  const std::string model = dir.str() + "/model";
  Synth("tiny", model);
  const std::string name = UniqueName("squat");
  Subprocess theirs =
      ServeStore(user.As({Bin("lorastream-store"), "serve", model, "--name", name, "--no-lock"}),
                 name, dir.str() + "/theirs.log");

  // Attaching it as root (the worker's user) is refused before anything is mapped.
  try {
    AttachedStore::Attach(name);
    FAIL("attached another user's store");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kRefused);
    CHECK_THAT(e.what(), Catch::Contains("belongs to " + user.name()) &&
                             Catch::Contains("not to the expected store user root (uid 0)") &&
                             Catch::Contains("--store-user"));
  }
  // Serving the same name says who holds it and how to proceed.
  int code = -1;
  const std::string err = dir.str() + "/ours.err";
  RunAndCapture({Bin("lorastream-store"), "serve", model, "--name", name, "--no-lock"}, &code, 120,
                err);
  CHECK(code != 0);
  CHECK_THAT(ReadAll(err), Catch::Contains("is held by " + user.name()) &&
                               Catch::Contains("choose another --name"));
  // A worker told to trust that user (--store-user) attaches it.
  SetTrustedStoreOwner(user.uid());
  CHECK_NOTHROW(AttachedStore::Attach(name));
  SetTrustedStoreOwner(::geteuid());
  theirs.Stop(30);
}

TEST_CASE("a segment of another user inside an own store is refused by name", "[store]") {
  TempUser user("sg");
  SKIP_UNLESS_ROOT(user);
  TempDir dir("store");
  const std::string model = dir.str() + "/model";
  Synth("tiny", model);
  const std::string name = UniqueName("seg");
  Subprocess store =
      ServeStore({Bin("lorastream-store"), "serve", model, "--name", name, "--no-lock"}, name,
                 dir.str() + "/store.log");
  std::string block;
  {
    AttachedStore attached = AttachedStore::Attach(name);  // all ours: fine
    block = attached.manifest().blocks.at(1).shm_name;
  }
  // As if the other user had put its own object under that name.
  REQUIRE(::chown((std::string(kShmDir) + block).c_str(), user.uid(), user.gid()) == 0);
  try {
    AttachedStore::Attach(name);
    FAIL("attached a segment of another user");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kRefused);
    CHECK_THAT(e.what(), Catch::Contains(block + " belongs to " + user.name()) &&
                             Catch::Contains("expected store user root"));
  }
  store.Stop(30);
}

TEST_CASE("ls as another user: a store it cannot read is not called orphaned", "[store][hostile]") {
  TempUser user("ls");
  SKIP_UNLESS_ROOT(user);
  TempDir dir("store");
  const std::string model = dir.str() + "/model";
  Synth("tiny", model);
  const std::string name = UniqueName("rootls");
  Subprocess store =
      ServeStore({Bin("lorastream-store"), "serve", model, "--name", name, "--no-lock"}, name,
                 dir.str() + "/store.log");
  // The live root store's manifest is owner-only: the user cannot read it, but it is there.
  int code = -1;
  const std::string out =
      RunAndCapture(user.As({Bin("lorastream-store"), "ls"}), &code, 120, dir.str() + "/ls.err");
  CHECK(code == 0);
  INFO(out);
  CHECK_THAT(out, Catch::Contains(name + ": not readable by you (owner uid 0)"));
  CHECK_THAT(out, !Catch::Contains(name + ": orphaned"));
  // Root reads it as it always has.
  const std::string ours =
      RunAndCapture({Bin("lorastream-store"), "ls"}, &code, 120, dir.str() + "/ls-root.err");
  CHECK_THAT(ours, Catch::Contains(name + ": published"));
  store.Stop(30);
}
