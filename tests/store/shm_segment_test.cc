#include "store/shm_segment.h"

#include <sys/mman.h>

#include <utility>

#include <catch2/catch.hpp>

#include "common/base/error.h"
#include "test_util.h"

using namespace lorastream;
using namespace lorastream::store;

TEST_CASE("a moved ShmSegment keeps its mapping, ownership and huge-page advice", "[store]") {
  const std::string name = "/lorastream-" + testing::UniqueName("move");
  ShmSegment created = ShmSegment::Create(name, 3 * 4096 + 1, 0600, /*huge_pages=*/true);
  // madvise(MADV_HUGEPAGE) is accepted wherever the kernel has THP, even with shmem THP off.
  REQUIRE(created.huge_pages_advised());
  const uint8_t* data = created.data();
  created.mutable_data()[5] = 42;

  ShmSegment moved(std::move(created));
  CHECK(created.data() == nullptr);
  CHECK(moved.data() == data);
  CHECK(moved.size() == 3 * 4096 + 1);
  CHECK(moved.mapped_size() == RoundUpToPage(3 * 4096 + 1));
  CHECK(moved.huge_pages_advised());
  CHECK(moved.mutable_data()[5] == 42);  // still writable

  ShmSegment assigned;
  assigned = std::move(moved);
  CHECK(assigned.huge_pages_advised());
  CHECK_FALSE(moved.huge_pages_advised());
  CHECK(assigned.data() == data);

  ShmSegment reader = ShmSegment::OpenReadOnly(name, 3 * 4096 + 1);
  CHECK(reader.data()[5] == 42);
  CHECK_FALSE(reader.huge_pages_advised());
  { ShmSegment gone = std::move(assigned); }  // the owner's last handle unlinks the name
  CHECK_THROWS_AS(ShmSegment::OpenReadOnly(name, 1), Error);
  CHECK(reader.data()[5] == 42);  // an attached mapping outlives the name
}
