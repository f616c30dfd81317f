// HostBytes (worker/stream/host_bytes.h): the page-aligned host buffer every packed or
// converted streaming source lives in holds every page its bytes touch, zeroed, and moves.
#include "worker/stream/host_bytes.h"

#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdint>
#include <utility>

namespace lorastream::worker {
namespace {

TEST_CASE("host bytes: page-aligned, every page the bytes touch, zeroed", "[worker][host_bytes]") {
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  for (uint64_t n : {uint64_t{0}, uint64_t{1}, page - 1, page, page + 1, 3 * page + 17}) {
    INFO(n << " bytes");
    const HostBytes b = HostBytes::Allocate(n, "test");
    CHECK(b.size() == n);
    CHECK(reinterpret_cast<uintptr_t>(b.data()) % page == 0);
    CHECK(b.mapped_size() == (n == 0 ? page : (n + page - 1) / page * page));
    uint64_t nonzero = 0;
    for (uint64_t i = 0; i < b.mapped_size(); ++i) nonzero += b.data()[i] != 0;
    CHECK(nonzero == 0);
  }
}

TEST_CASE("host bytes: a move hands the pages over; read-only keeps them readable",
          "[worker][host_bytes]") {
  HostBytes a = HostBytes::Allocate(100, "test");
  a.data()[99] = 7;
  uint8_t* const data = a.data();
  HostBytes b = std::move(a);
  CHECK(a.data() == nullptr);
  CHECK(a.size() == 0);
  CHECK(b.data() == data);
  b.MakeReadOnly();
  CHECK(b.data()[99] == 7);
}

}  // namespace
}  // namespace lorastream::worker
