#include "common/subprocess.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <functional>

#include <catch2/catch.hpp>

#include "common/error.h"
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
