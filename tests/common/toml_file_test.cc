#include "common/toml_file.h"

#include <catch2/catch.hpp>

#include "common/error.h"

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
