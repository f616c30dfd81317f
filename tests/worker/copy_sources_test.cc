// The choice between direct copies from registered host memory and the pinned staging path
// (worker/stream/copy_sources.h), driven through HostRegistrar by registrars that succeed or fail
// as each test says: the decision the CUDA backend takes, tested without CUDA.
#include "worker/stream/copy_sources.h"

#include <catch2/catch.hpp>
#include <set>

#include "common/base/error.h"

namespace lorastream::worker {
namespace {

// Registers what is not in `refused` (failing those with the driver's words) and counts the
// calls and the registrations still held.
class FakeRegistrar : public HostRegistrar {
 public:
  std::set<const void*> refused;
  int calls = 0;
  int held = 0;

  std::unique_ptr<RegisteredRange> Register(const void* ptr, uint64_t bytes,
                                            std::string* error) override {
    ++calls;
    if (refused.count(ptr)) {
      *error = "cudaErrorMemoryAllocation (out of memory)";
      return nullptr;
    }
    return std::make_unique<Range>(&held);
  }

 private:
  class Range : public RegisteredRange {
   public:
    explicit Range(int* held) : held_(held) { ++*held_; }
    ~Range() override { --*held_; }

   private:
    int* held_;
  };
};

const uint8_t kBlocks[3][64] = {};

}  // namespace

TEST_CASE("copy sources: registered blocks are copied directly, held until the end",
          "[worker][copy_sources]") {
  FakeRegistrar registrar;
  {
    CopySources sources(&registrar, /*force_staging=*/false, StagingPool{});
    CHECK(sources.Add(kBlocks[0], 64) == CopyPath::kDirect);
    CHECK(sources.Add(kBlocks[1], 64) == CopyPath::kDirect);
    CHECK(sources.Add(kBlocks[0], 64) == CopyPath::kDirect);  // seen before: not again
    CHECK(registrar.calls == 2);
    CHECK(registrar.held == 2);
    CHECK(sources.PathOf(kBlocks[1]) == CopyPath::kDirect);
    CHECK(sources.staging_reason().empty());
  }
  CHECK(registrar.held == 0);
}

TEST_CASE("copy sources: a block that cannot be registered is staged, said once with why",
          "[worker][copy_sources]") {
  FakeRegistrar registrar;
  registrar.refused = {kBlocks[0], kBlocks[2]};
  CopySources sources(&registrar, /*force_staging=*/false, StagingPool{4, uint64_t{32} << 20});
  CHECK(sources.Add(kBlocks[0], 64) == CopyPath::kStaged);
  const std::string reason = sources.staging_reason();
  CHECK_THAT(reason, Catch::Contains("cudaErrorMemoryAllocation (out of memory)"));
  CHECK_THAT(reason, Catch::Contains("4 pinned staging buffers of 32 MiB"));
  CHECK_THAT(reason, Catch::Contains("ulimit -l"));
  // The others still go straight when they can; a refused one is not retried.
  CHECK(sources.Add(kBlocks[1], 64) == CopyPath::kDirect);
  CHECK(sources.Add(kBlocks[2], 64) == CopyPath::kStaged);
  CHECK(sources.Add(kBlocks[0], 64) == CopyPath::kStaged);
  CHECK(registrar.calls == 3);
  CHECK(registrar.held == 1);
  CHECK(sources.staging_reason() == reason);  // the first fallback's words, kept
  CHECK(sources.PathOf(kBlocks[0]) == CopyPath::kStaged);
  CHECK(sources.PathOf(kBlocks[1]) == CopyPath::kDirect);
}

TEST_CASE("copy sources: force_staging stages every block without registering any",
          "[worker][copy_sources]") {
  FakeRegistrar registrar;
  CopySources sources(&registrar, /*force_staging=*/true, StagingPool{});
  for (const uint8_t* block : kBlocks)
    CHECK(sources.Add(block, sizeof(kBlocks[0])) == CopyPath::kStaged);
  CHECK(registrar.calls == 0);
  CHECK_THAT(sources.staging_reason(), Catch::Contains("force_staging"));
}

TEST_CASE("copy sources: a copy from a block never added is an internal error",
          "[worker][copy_sources]") {
  FakeRegistrar registrar;
  CopySources sources(&registrar, /*force_staging=*/false, StagingPool{});
  sources.Add(kBlocks[0], 64);
  try {
    sources.PathOf(kBlocks[1]);
    FAIL("no error");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kInternal);
    CHECK_THAT(e.what(), Catch::Contains("never added"));
  }
}

}  // namespace lorastream::worker
