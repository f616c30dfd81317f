#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <type_traits>
#include <utility>

#include <catch2/catch.hpp>

#include "common/base/error.h"
#include "common/posix/memory_mapping.h"
#include "common/posix/unique_fd.h"

using lorastream::MemoryMapping;
using lorastream::UniqueFd;

namespace {

bool IsOpen(int fd) { return ::fcntl(fd, F_GETFD) != -1; }

// Whether [p, p + n) is mapped in this process (msync fails with ENOMEM on a hole).
bool IsMapped(void* p, size_t n) { return ::msync(p, n, MS_ASYNC) == 0; }

}  // namespace

static_assert(!std::is_copy_constructible_v<UniqueFd> &&
              std::is_nothrow_move_constructible_v<UniqueFd>);
static_assert(!std::is_copy_constructible_v<MemoryMapping> &&
              std::is_nothrow_move_constructible_v<MemoryMapping>);

TEST_CASE("UniqueFd closes once, moves ownership, releases and keeps errno", "[common]") {
  int raw = -1;
  {
    UniqueFd fd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
    REQUIRE(fd.valid());
    raw = fd.get();
    UniqueFd moved(std::move(fd));
    CHECK_FALSE(fd.valid());
    CHECK(moved.get() == raw);
    UniqueFd assigned;
    assigned = std::move(moved);
    CHECK(assigned.get() == raw);
    CHECK(IsOpen(raw));
  }
  CHECK_FALSE(IsOpen(raw));  // closed when its last owner died

  UniqueFd fd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  const int released = fd.Release();
  CHECK_FALSE(fd.valid());
  CHECK(IsOpen(released));  // Release hands it over unclosed
  fd.Reset(released);
  errno = EACCES;
  fd.Reset();  // closing keeps the errno a caller is about to report
  CHECK(errno == EACCES);
  CHECK_FALSE(IsOpen(released));

  UniqueFd replaced(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  const int first = replaced.get();
  UniqueFd other(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  const int second = other.get();
  replaced = std::move(other);  // the old descriptor is closed, the new one kept
  CHECK_FALSE(IsOpen(first));
  CHECK(IsOpen(second));
}

TEST_CASE("MakePipe gives two owned ends", "[common]") {
  int r = -1, w = -1;
  {
    lorastream::UniquePipe pipe = lorastream::MakePipe(O_CLOEXEC, "pipe");
    r = pipe.read_end.get();
    w = pipe.write_end.get();
    REQUIRE(::write(w, "x", 1) == 1);
    char c = 0;
    REQUIRE(::read(r, &c, 1) == 1);
    CHECK(c == 'x');
  }
  CHECK_FALSE(IsOpen(r));
  CHECK_FALSE(IsOpen(w));
}

TEST_CASE("MemoryMapping unmaps once, moves ownership and names a failed mmap", "[common]") {
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  void* p = nullptr;
  {
    MemoryMapping map = MemoryMapping::Map(2 * page, PROT_READ | PROT_WRITE,
                                           MAP_PRIVATE | MAP_ANONYMOUS, -1, 0, "test mapping");
    REQUIRE(map.valid());
    CHECK(map.size() == 2 * page);
    p = map.data();
    map.bytes()[page] = 7;
    MemoryMapping moved(std::move(map));
    CHECK_FALSE(map.valid());
    CHECK(map.size() == 0);
    CHECK(moved.bytes()[page] == 7);
    MemoryMapping assigned;
    assigned = std::move(moved);
    CHECK(assigned.data() == p);
    CHECK(IsMapped(p, 2 * page));
  }
  CHECK_FALSE(IsMapped(p, 2 * page));

  MemoryMapping a = MemoryMapping::Map(page, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0, "a");
  MemoryMapping b = MemoryMapping::Map(page, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0, "b");
  void* old = a.data();
  a = std::move(b);  // the old mapping goes, the new one stays
  CHECK_FALSE(IsMapped(old, page));
  CHECK(IsMapped(a.data(), page));

  try {
    MemoryMapping::Map(page, PROT_READ, MAP_SHARED, /*fd=*/-1, 0, "mmap(nothing)");
    FAIL("mmap of fd -1 succeeded");
  } catch (const lorastream::Error& e) {
    CHECK_THAT(e.what(), Catch::Contains("mmap(nothing)"));
  }
}
