#include "common/subprocess.h"

#include <signal.h>

#include <catch2/catch.hpp>

#include "common/error.h"

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
