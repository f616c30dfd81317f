#include "common/formats/npz.h"

#include <cstring>
#include <fstream>

#include <catch2/catch.hpp>

#include "common/base/error.h"
#include "tests/support/flux_cache_files.h"
#include "tests/support/test_support.h"

using namespace lorastream;
using lorastream::testing::FloatArray;
using lorastream::testing::TempDir;

namespace {

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void WriteAll(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string ErrorOf(const std::string& path) {
  return lorastream::testing::ErrorMessageOf([&] { ReadNpz(path); });
}

}  // namespace

TEST_CASE("npz: stored and deflated archives in numpy's zip64 layout round-trip", "[common][npz]") {
  TempDir dir("npz");
  NpyArray half;
  half.kind = 'f';
  half.itemsize = 2;
  half.shape = {3};
  const uint16_t bits[3] = {0x3c00, 0xc000, 0x0001};  // 1, -2, the smallest subnormal
  half.data.resize(6);
  std::memcpy(half.data.data(), bits, 6);
  NpyArray flag;
  flag.kind = 'b';
  flag.itemsize = 1;
  flag.data = {1};  // a 0-d bool, as sd-scripts saves apply_t5_attn_mask
  const std::map<std::string, NpyArray> arrays = {
      {"latents_4x6", FloatArray({16, 4, 6}, 1)}, {"half", half}, {"flag", flag}};
  for (bool compressed : {false, true}) {
    const std::string path = dir.str() + (compressed ? "/c.npz" : "/s.npz");
    WriteNpz(path, arrays, compressed);
    const auto back = ReadNpz(path);
    REQUIRE(back.size() == 3);
    CHECK(back.at("latents_4x6").shape == std::vector<int64_t>{16, 4, 6});
    CHECK(back.at("latents_4x6").data == arrays.at("latents_4x6").data);
    const auto h = back.at("half").ToFloat("half");
    CHECK(h[0] == 1.0f);
    CHECK(h[1] == -2.0f);
    CHECK(h[2] == Approx(5.960464477539063e-08f));
    CHECK(back.at("flag").shape.empty());
    CHECK(back.at("flag").ToFloat("flag")[0] == 1.0f);
  }
  CHECK(ReadAll(dir.str() + "/c.npz").size() < ReadAll(dir.str() + "/s.npz").size());
}

TEST_CASE("npz: truncated, damaged and unsupported files are refused naming the file",
          "[common][npz]") {
  TempDir dir("npz-bad");
  const std::string good = dir.str() + "/good.npz";
  WriteNpz(good, {{"x", FloatArray({4, 4}, 3)}});
  const std::string bytes = ReadAll(good);

  const std::string cut = dir.str() + "/cut.npz";
  WriteAll(cut, bytes.substr(0, bytes.size() / 2));
  const std::string e1 = ErrorOf(cut);
  CHECK_THAT(e1, Catch::Contains(cut));
  CHECK_THAT(e1, Catch::Contains("truncated"));

  std::string flipped = bytes;
  flipped[bytes.size() / 2] ^= 0x55;  // inside the array's data
  const std::string bad = dir.str() + "/flipped.npz";
  WriteAll(bad, flipped);
  CHECK_THAT(ErrorOf(bad), Catch::Contains("CRC-32"));

  const std::string text = dir.str() + "/text.npz";
  WriteAll(text, std::string(100, 'a'));
  CHECK_THAT(ErrorOf(text), Catch::Contains("end-of-directory"));

  NpyArray complex64;
  complex64.kind = 'c';
  complex64.itemsize = 8;
  complex64.shape = {1};
  complex64.data.assign(8, 0);
  const std::string odd = dir.str() + "/complex.npz";
  WriteNpz(odd, {{"z", complex64}});
  CHECK_THAT(ErrorOf(odd), Catch::Contains("unsupported dtype"));
  CHECK_THAT(ErrorOf(dir.str() + "/absent.npz"), Catch::Contains("cannot be opened"));
}

TEST_CASE("npy: a header whose shape disagrees with the data is refused", "[common][npz]") {
  std::string npy("\x93NUMPY\x01\x00", 8);
  std::string dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (3, 2), }";
  while ((10 + dict.size() + 1) % 64) dict.push_back(' ');
  dict.push_back('\n');
  npy.push_back(static_cast<char>(dict.size()));
  npy.push_back(0);
  npy += dict + std::string(20, '\0');  // 24 bytes needed
  const auto* p = reinterpret_cast<const uint8_t*>(npy.data());
  try {
    ParseNpy(p, npy.size(), "x.npy");
    FAIL("accepted");
  } catch (const Error& e) {
    CHECK_THAT(std::string(e.what()), Catch::Contains("needs 24 bytes of data, 20 present"));
  }
  npy += std::string(4, '\0');
  CHECK(ParseNpy(p = reinterpret_cast<const uint8_t*>(npy.data()), npy.size(), "x.npy").numel() ==
        6);
}
