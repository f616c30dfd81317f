#include "common/formats/toml_file.h"

#include <catch2/catch.hpp>

#include "common/base/error.h"

using lorastream::Error;
using lorastream::TomlSection;

TEST_CASE("TOML values are read with their types", "[common]") {
  auto doc = TomlSection::Parse(
      "name = \"x\"\nsteps = 3\nlr = 1e-4\n[lora]\nrank = 8\n"
      "targets = [\"q_proj\", \"v_proj\"]\n",
      "job.toml");
  CHECK(doc.RequireString("name") == "x");
  CHECK(doc.GetInt("steps", 0) == 3);
  CHECK(doc.GetDouble("lr", 0) == Approx(1e-4));
  CHECK(doc.GetDouble("steps", 0) == 3.0);
  CHECK(doc.Section("lora").GetInt("rank", 0) == 8);
  CHECK(doc.Section("lora").GetStrings("targets", {}).size() == 2);
  CHECK(doc.Section("missing").GetInt("rank", 5) == 5);
}

TEST_CASE("TOML errors name the file, the key and what was expected", "[common]") {
  auto doc = TomlSection::Parse("steps = \"many\"\n[lora]\nrank = 1.5\nranke = 2\n", "job.toml");
  try {
    doc.GetInt("steps", 0);
    FAIL("no error");
  } catch (const Error& e) {
    CHECK(std::string(e.what()) == "job.toml: key `steps` must be an integer, found a string");
  }
  CHECK_THROWS_WITH(doc.Section("lora").GetInt("rank", 0),
                    Catch::Contains("key `lora.rank` must be an integer, found a float"));
  CHECK_THROWS_WITH(doc.Section("lora").RejectUnknownKeys({"rank"}),
                    Catch::Contains("`lora.ranke` is not a known key"));
  CHECK_THROWS_WITH(doc.RequireString("name"), Catch::Contains("`name` is required"));
  CHECK_THROWS_WITH(TomlSection::Parse("a = = 1", "bad.toml"),
                    Catch::StartsWith("bad.toml:1:") && Catch::Contains("TOML syntax error"));
  CHECK_THROWS_AS(TomlSection::Load("/nonexistent/job.toml"), Error);
}

TEST_CASE("a job file's wrong type is invalid input (exit 2), not a corrupt file", "[common]") {
  auto doc = TomlSection::Parse("[optim]\nlr = \"fast\"\nranke = 1\n", "job.toml");
  auto code_of = [](const auto& f) {
    try {
      f();
    } catch (const Error& e) {
      return e.code();
    }
    return lorastream::ErrorCode::kOk;
  };
  const auto optim = doc.Section("optim");
  CHECK(code_of([&] { optim.GetDouble("lr", 0); }) == lorastream::ErrorCode::kInvalidArgument);
  CHECK_THROWS_WITH(optim.GetDouble("lr", 0),
                    "job.toml: key `optim.lr` must be a number, found a string");
  CHECK(code_of([&] { optim.RejectUnknownKeys({"lr"}); }) ==
        lorastream::ErrorCode::kInvalidArgument);
  CHECK(code_of([&] { doc.RequireString("name"); }) == lorastream::ErrorCode::kInvalidArgument);
  CHECK(lorastream::ExitCodeFor(lorastream::ErrorCode::kInvalidArgument) == 2);
  // An unsupported model is refused with the same status by every command (store serve, train).
  CHECK(lorastream::ExitCodeFor(lorastream::ErrorCode::kUnsupported) ==
        lorastream::ExitCodeFor(lorastream::ErrorCode::kRefused));
}
