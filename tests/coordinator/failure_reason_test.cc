// Issue 42: a LibTorch error reaches a job's failure reason (and the worker's log) as what went
// wrong, without the dozens of "frame #N" lines of its backtrace.
#include <catch2/catch.hpp>

#include <stdexcept>

#include "coordinator/client/worker_agent.h"

using namespace lorastream;

TEST_CASE("a LibTorch error becomes a one-line job reason without its backtrace",
          "[coordinator][hostile]") {
  // c10::Error's what(): the message (here of two lines), then the backtrace.
  const std::string what =
      "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough memory:\n"
      "you tried to allocate 68736254976 bytes.\n"
      "Exception raised from alloc_cpu at ../c10/core/impl/alloc_cpu.cpp:117 (most recent call "
      "first):\n"
      "frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x1\n"
      "frame #1: c10::alloc_cpu(unsigned long) + 0x2\n";
  JobAssignment a;
  a.job_id = 7;
  a.attempt = 1;
  const client::JobResult r =
      client::FailedResult(std::make_exception_ptr(std::runtime_error(what)), a);
  CHECK(r.kind == client::JobResult::Kind::kFailed);
  CHECK(r.reason ==
        "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough memory: you "
        "tried to allocate 68736254976 bytes.");
  CHECK(r.reason.find("frame #") == std::string::npos);
  CHECK(r.reason.find('\n') == std::string::npos);
}
