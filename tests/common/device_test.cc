// The one parser of device names and compute dtypes (common/base/device.h, common/base/dtype.h).
#include "common/base/device.h"

#include <catch2/catch.hpp>

#include "common/base/error.h"

namespace lorastream {

TEST_CASE("devices: cpu, cuda and cuda:N parse; anything else is an error naming it",
          "[common][device]") {
  CHECK_FALSE(ParseDevice("cpu").is_cuda());
  CHECK(ParseDevice("cpu").str() == "cpu");
  const Device first = ParseDevice("cuda");
  CHECK(first.is_cuda());
  CHECK(first.index == 0);
  CHECK(first.str() == "cuda:0");
  CHECK(ParseDevice("cuda:3").index == 3);
  CHECK(ParseDevice("cuda:12").str() == "cuda:12");
  for (const char* bad : {"", "gpu", "CPU", "cuda:", "cuda:-1", "cuda:1x", "cuda:x", "cuda1",
                          "cuda:99999999999", " cpu", "cpu:0", "mps"}) {
    CAPTURE(bad);
    try {
      ParseDevice(bad, "--device");
      FAIL("parsed");
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::kInvalidArgument);
      CHECK_THAT(e.what(), Catch::Contains(std::string("--device `") + bad + "` is not a device"));
    }
  }
}

TEST_CASE("compute dtypes: f32, bf16 and auto by device; short spellings round-trip",
          "[common][device]") {
  CHECK(ComputeDType("auto", ParseDevice("cpu")) == DType::kF32);
  CHECK(ComputeDType("auto", ParseDevice("cuda:1")) == DType::kBF16);
  CHECK(ComputeDType("f32", ParseDevice("cuda")) == DType::kF32);
  CHECK(ComputeDType("bf16", ParseDevice("cpu")) == DType::kBF16);
  for (const char* bad : {"f16", "fp32", "bfloat16", "F32", ""}) {
    CAPTURE(bad);
    CHECK_FALSE(ParseComputeDType(bad, Device{}));
    CHECK_THROWS_WITH(ComputeDType(bad, Device{}, "train.dtype"),
                      Catch::Contains(std::string("train.dtype `") + bad + "`"));
  }
  for (DType d : {DType::kF32, DType::kF16, DType::kBF16})
    CHECK(ParseShortDType(ShortDTypeName(d)) == d);
  CHECK_FALSE(ParseShortDType("F32"));
  CHECK(std::string(ShortDTypeName(DType::kI64)).empty());
}

}  // namespace lorastream
