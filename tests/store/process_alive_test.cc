// Liveness of a store's owner process: a zombie counts as dead.
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <fstream>
#include <string>
#include <thread>

#include "store/process.h"

using namespace lorastream;
using namespace lorastream::store;

TEST_CASE("a zombie store process counts as dead", "[store]") {
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) ::_exit(0);
  // Not reaped yet: wait (with a deadline) until the kernel shows it as a zombie.
  auto state = [&] {
    std::ifstream in("/proc/" + std::to_string(child) + "/stat");
    std::string text;
    std::getline(in, text);
    const size_t close = text.rfind(')');
    return close == std::string::npos || close + 2 >= text.size() ? '?' : text[close + 2];
  };
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (state() != 'Z' && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  REQUIRE(state() == 'Z');
  const uint64_t start = ProcessStartTime(child);
  CHECK(start != 0);
  CHECK(!ProcessAlive(child, start));
  CHECK(!ProcessAlive(child, 0));
  ::waitpid(child, nullptr, 0);
  CHECK(!ProcessAlive(child, start));
  CHECK(ProcessAlive(::getpid(), ProcessStartTime(::getpid())));
}
