#include "common/posix/subprocess.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>

#include "common/base/error.h"
#include "tests/support/test_support.h"

using lorastream::Error;
using lorastream::RunAndCapture;
using lorastream::Subprocess;

TEST_CASE("subprocess exit codes, signals and capture", "[common]") {
  int code = -5;
  CHECK(RunAndCapture({"sh", "-c", "echo hello; exit 3"}, &code) == "hello\n");
  CHECK(code == 3);

  Subprocess sleeper = Subprocess::Spawn({"sleep", "30"});
  CHECK(sleeper.Running());
  CHECK(sleeper.Wait(0.05) == -1);
  sleeper.Signal(SIGKILL);
  CHECK(sleeper.Wait(5) == 128 + SIGKILL);
  CHECK_FALSE(sleeper.Running());

  Subprocess term = Subprocess::Spawn({"sleep", "30"});
  CHECK(term.Stop(5) == 128 + SIGTERM);

  RunAndCapture({"sleep", "30"}, &code, 0.2);  // killed at its time limit
  CHECK(code == 128 + SIGTERM);
}

TEST_CASE("a program that cannot start is a clear error", "[common]") {
  CHECK_THROWS_WITH(Subprocess::Spawn({"/nonexistent/program"}),
                    Catch::Contains("cannot start /nonexistent/program"));
  CHECK_THROWS_AS(Subprocess::Spawn({}), Error);
}

namespace {

// The number the next open() gets: the lowest free descriptor.
int LowestFreeFd() {
  const int fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  REQUIRE(fd >= 0);
  ::close(fd);
  return fd;
}

}  // namespace

TEST_CASE("a spawn that runs out of descriptors half-way leaks none", "[common]") {
  const lorastream::testing::TempDir temp("spawn");
  const std::string log = temp / "child.log";
  rlimit saved{};
  REQUIRE(getrlimit(RLIMIT_NOFILE, &saved) == 0);
  const int free_fd = LowestFreeFd();
  lorastream::SpawnOptions options;
  options.log_path = log;
  // Room for `room` more descriptors, then the call, then the limit restored.
  auto throws_with_room = [&](int room, const std::function<void()>& call) {
    rlimit tight = saved;
    tight.rlim_cur = static_cast<rlim_t>(free_fd + room);
    REQUIRE(setrlimit(RLIMIT_NOFILE, &tight) == 0);
    bool threw = false;
    try {
      call();
    } catch (const Error&) {
      threw = true;
    }
    REQUIRE(setrlimit(RLIMIT_NOFILE, &saved) == 0);
    return threw;
  };
  // One: the log file opens, the exec-report pipe cannot be made.
  CHECK(throws_with_room(1, [&] { Subprocess::Spawn({"true"}, options); }));
  CHECK(LowestFreeFd() == free_fd);
  // Two: RunAndCapture's output pipe takes both, then the log file cannot be opened.
  int code = -5;
  CHECK(throws_with_room(2, [&] { RunAndCapture({"true"}, &code, 60, log); }));
  CHECK(LowestFreeFd() == free_fd);
}

namespace {

// Whether `pid` is gone: no such process, or a zombie waiting for init to reap it (it has
// ended; only its exit status is left).
bool Gone(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text;
  if (!std::getline(stat, text)) return true;
  const size_t paren = text.rfind(')');  // the command name may hold spaces and parentheses
  return paren == std::string::npos || text.compare(paren + 1, 3, " Z ") == 0;
}

// Forks an intermediate process (a copy of this test, not exec'd) that spawns `argv` with
// `options`, reports the child's pid and waits to be killed. Returns {intermediate, child}.
std::pair<pid_t, pid_t> SpawnThroughIntermediate(const std::vector<std::string>& argv,
                                                 const lorastream::SpawnOptions& options) {
  int report[2];
  REQUIRE(::pipe(report) == 0);
  const pid_t intermediate = ::fork();
  REQUIRE(intermediate >= 0);
  if (intermediate == 0) {
    ::close(report[0]);
    pid_t child = -1;
    try {
      Subprocess s = Subprocess::Spawn(argv, options);
      child = s.pid();
      s.Detach();  // the intermediate dies by SIGKILL: nothing of it runs after that anyway
    } catch (...) {
    }
    if (::write(report[1], &child, sizeof child) != sizeof child) ::_exit(1);
    for (;;) ::pause();
  }
  ::close(report[1]);
  pid_t child = -1;
  const ssize_t n = ::read(report[0], &child, sizeof child);
  ::close(report[0]);
  REQUIRE(n == sizeof child);
  REQUIRE(child > 0);
  return {intermediate, child};
}

void KillAndReap(pid_t pid) {
  REQUIRE(::kill(pid, SIGKILL) == 0);
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
}

}  // namespace

TEST_CASE("a child dies when its parent dies, unless spawned to outlive it", "[common]") {
  using lorastream::testing::WaitFor;
  const lorastream::testing::TempDir temp("pdeathsig");
  // Waits for `go`, then writes `out`: proof that it was still alive after its parent died.
  const std::string go = temp / "go", out = temp / "out";
  const std::vector<std::string> argv = {
      "sh", "-c", "while [ ! -e '" + go + "' ]; do sleep 0.02; done; echo alive > '" + out + "'"};

  SECTION("by default the kernel ends it (SIGTERM) when the parent is killed") {
    const auto [intermediate, child] = SpawnThroughIntermediate(argv, {});
    CHECK_FALSE(Gone(child));
    KillAndReap(intermediate);
    CHECK(WaitFor([child = child] { return Gone(child); }, 30));
    std::ofstream(go).put('\n');
    CHECK_FALSE(std::ifstream(out).good());
  }
  SECTION("die_with_parent = false: it keeps running") {
    lorastream::SpawnOptions options;
    options.die_with_parent = false;
    const auto [intermediate, child] = SpawnThroughIntermediate(argv, options);
    KillAndReap(intermediate);
    std::ofstream(go).put('\n');
    CHECK(WaitFor([&out] { return std::ifstream(out).good(); }, 30));
    CHECK(WaitFor([child = child] { return Gone(child); }, 30));
  }
}
