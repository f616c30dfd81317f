// Issue 42, "Reliability, third pass": no input reaches the TOML parser or the allocator
// unbounded, files are opened only when they are regular files, and every refusal names the
// file, key or tensor and the rule.
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>

#include <catch2/catch.hpp>

#include "common/base/cli_main.h"
#include "common/base/error.h"
#include "common/formats/data.h"
#include "common/formats/flux_cache.h"
#include "common/formats/flux_config.h"
#include "common/formats/npz.h"
#include "common/formats/safetensors.h"
#include "common/formats/tokenizer_id.h"
#include "common/formats/toml_file.h"
#include "common/job/flux_job.h"
#include "common/job/job_spec.h"
#include "common/posix/regular_file.h"
#include "tests/support/flux_cache_files.h"
#include "tests/support/test_support.h"

using namespace lorastream;
using lorastream::testing::ErrorMessageOf;
using lorastream::testing::TempDir;

namespace {

void WriteText(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

// `levels` tables deep in one header: "[a.a.a...]".
std::string DeepHeader(int levels) {
  std::string header = "[a";
  for (int i = 1; i < levels; ++i) header += ".a";
  return header + "]\nx = 1\n";
}

// Seconds `f` takes (a call that blocks on a FIFO would never return: the test would hang).
double SecondsOf(const std::function<void()>& f) {
  const auto start = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

FluxConfig Tiny() {
  FluxConfig c;
  c.hidden_size = 64;
  c.num_heads = 4;
  c.axes_dim = {4, 6, 6};
  c.depth = 2;
  c.depth_single = 3;
  c.mlp_hidden = 256;
  c.vec_in_dim = 32;
  c.context_in_dim = 48;
  return c;
}

// A BFL-named checkpoint of `config`'s tensors (zeros), renamed by `rename` and with metadata
// edited by `meta`.
std::string WriteBfl(const std::string& path, const FluxConfig& config,
                     const std::function<std::string(const std::string&)>& rename = {},
                     const std::function<void(std::map<std::string, std::string>&)>& meta = {}) {
  static std::vector<float> zeros(1 << 16);
  std::vector<TensorToWrite> t;
  for (const auto& [name, shape] : FluxAllShapes(config))
    t.push_back({rename ? rename(name) : name, DType::kF32, shape, zeros.data()});
  auto metadata = FluxMetadata(config);
  if (meta) meta(metadata);
  WriteSafetensors(path, t, metadata);
  return path;
}

std::string ConfigError(const std::string& path) {
  return ErrorMessageOf([&] { FluxConfigFromHeader(SafetensorsFile::Open(path).header(), path); });
}

}  // namespace

TEST_CASE("a TOML text nesting past the limit is refused naming the file, before the parser",
          "[common][hostile]") {
  // 50,000 levels: toml++ overflowed the stack on this (SIGSEGV in submit, the worker and the
  // coordinator reading its journal).
  std::string e = ErrorMessageOf([] { TomlSection::Parse(DeepHeader(50000), "deep.toml"); });
  CHECK_THAT(e, Catch::Contains("deep.toml:1"));
  CHECK_THAT(e, Catch::Contains("nests deeper than 64 levels"));
  // Arrays, inline tables and dotted keys count as levels too.
  std::string arrays = "x = " + std::string(50000, '[') + std::string(50000, ']') + "\n";
  CHECK_THAT(ErrorMessageOf([&] { TomlSection::Parse(arrays, "arrays.toml"); }),
             Catch::Contains("arrays.toml:1: nests deeper"));
  std::string inl = "x = ";
  for (int i = 0; i < 50000; ++i) inl += "{a = ";
  inl += "1" + std::string(50000, '}') + "\n";
  CHECK_THAT(ErrorMessageOf([&] { TomlSection::Parse(inl, "inline.toml"); }),
             Catch::Contains("inline.toml:1: nests deeper"));
  std::string dotted = "\n\na";
  for (int i = 0; i < 50000; ++i) dotted += ".a";
  dotted += " = 1\n";
  CHECK_THAT(ErrorMessageOf([&] { TomlSection::Parse(dotted, "dotted.toml"); }),
             Catch::Contains("dotted.toml:3: nests deeper"));
  // The limit is far above any real file: 60 levels parse; dots and brackets inside strings,
  // comments and values are not levels.
  CHECK(TomlSection::Parse(DeepHeader(60), "ok.toml").Has("a"));
  const std::string text =
      "# a.b.c.d [[[[ {{{{\n"
      "name = \"a.b.[c].{d}\"\n"
      "'q.q' = '''x.y.\n[z]]]\n'''\n"
      "lr = 1.5e-4\n"
      "list = [1.5, 2.5, [3.5, [4.5]], {a.b = 1.5}]\n"
      "[x.y]\n"
      "[[arr.t]]\n"
      "v = \"\\\"[\"\n";
  const TomlSection ok = TomlSection::Parse(text, "ok.toml");
  CHECK(ok.GetString("name", "") == "a.b.[c].{d}");
  CHECK(ok.GetDouble("lr", 0) == 1.5e-4);

  // The size limit, and every caller: a job file read by the worker (LoadJobSpec) and by
  // `submit` (ParseJobSpec).
  TempDir dir("toml-limits");
  const std::string job = dir / "deep.toml";
  WriteText(job, "name = \"x\"\n" + DeepHeader(50000));
  e = ErrorMessageOf([&] { LoadJobSpec(job); });
  CHECK_THAT(e, Catch::Contains(job));
  CHECK_THAT(e, Catch::Contains("nests deeper"));
  CHECK_THAT(ErrorMessageOf([&] { ParseJobSpec(DeepHeader(50000), "submitted.toml"); }),
             Catch::Contains("submitted.toml:1: nests deeper"));
  CHECK_THAT(ErrorMessageOf([&] { TomlSection::Load(job); }), Catch::Contains(job));
  std::string big(kMaxTomlBytes + 1, '#');
  CHECK_THAT(ErrorMessageOf([&] { TomlSection::Parse(big, "big.toml"); }),
             Catch::Contains("above the limit"));
}

TEST_CASE(
    "files named as input are opened only when regular: a FIFO or /dev/zero is refused "
    "at once by name",
    "[common][hostile]") {
  TempDir dir("regular-files");
  const std::string fifo = dir / "cache_0032x0032_flux.npz";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  const std::string zero = dir / "zero_flux_te.npz";
  REQUIRE(::symlink("/dev/zero", zero.c_str()) == 0);
  std::string e;
  // Each would block (the FIFO) or read until memory ends (/dev/zero) without the check.
  CHECK(SecondsOf([&] { e = ErrorMessageOf([&] { ReadNpz(fifo); }); }) < 5);
  CHECK_THAT(e, Catch::Contains(fifo));
  CHECK_THAT(e, Catch::Contains("not a regular file (it is a FIFO)"));
  e = ErrorMessageOf([&] { ReadNpz(zero); });
  CHECK_THAT(e, Catch::Contains(zero));
  CHECK_THAT(e, Catch::Contains("it is a character device"));

  const std::string data_fifo = dir / "data.jsonl";
  REQUIRE(::mkfifo(data_fifo.c_str(), 0600) == 0);
  CHECK(SecondsOf([&] { e = ErrorMessageOf([&] { LoadDocuments(data_fifo, "jsonl", 100); }); }) <
        5);
  CHECK_THAT(e, Catch::Contains("data.path " + data_fifo + ": not a regular file (it is a FIFO)"));
  // `submit` reads the data's tokenizer record when the store is on its host (it hung here).
  std::string why;
  CHECK(SecondsOf([&] {
          why = DataTokenizerProblem(
              data_fifo, "jsonl", [] { return std::optional<TokenizerId>(); }, "store `s`", 0);
        }) < 5);
  CHECK_THAT(why, Catch::Contains(data_fifo + ": not a regular file (it is a FIFO)"));
  // `submit` validates the job before sending it: data.path names the FIFO and what it is.
  JobSpec spec;
  spec.model.store = "s";
  spec.data.path = data_fifo;
  spec.data.format = "jsonl";
  spec.train.steps = 1;
  spec.train.output_dir = dir / "out";
  bool named = false;
  for (const std::string& p : ValidateJobSpec(spec))
    named =
        named || (p.find("data.path") != std::string::npos &&
                  p.find(data_fifo + " is not a regular file (it is a FIFO)") != std::string::npos);
  CHECK(named);

  // A streaming reader reads the file that was checked, not a FIFO swapped in after.
  const std::string swapped = dir / "swapped.jsonl";
  WriteText(swapped, "checked\n");
  {
    const UniqueFd fd = OpenRegularFile(swapped);
    REQUIRE(std::remove(swapped.c_str()) == 0);
    REQUIRE(::mkfifo(swapped.c_str(), 0600) == 0);
    std::string line;
    CHECK(SecondsOf([&] {
            std::ifstream in(DescriptorPath(fd, swapped), std::ios::binary);
            std::getline(in, line);
          }) < 5);
    CHECK(line == "checked");
  }
  // A directory read as a file names it (it was "basic_filebuf::underflow ... Is a directory").
  const std::string folder = dir / "job.toml";
  std::filesystem::create_directory(folder);
  e = ErrorMessageOf([&] { LoadJobSpec(folder); });
  CHECK_THAT(e, Catch::Contains("job file " + folder + ": not a regular file (it is a directory)"));
  const std::string model = dir / "model";
  std::filesystem::create_directories(model + "/config.json");
  CHECK_THAT(ErrorMessageOf([&] { ReadRegularFile(model + "/config.json", 100, "config.json"); }),
             Catch::Contains("it is a directory"));
  CHECK_THAT(ErrorMessageOf([&] { SafetensorsFile::Open(fifo); }),
             Catch::Contains("not a regular file (it is a FIFO)"));
}

TEST_CASE(
    "FLUX caches: a bucket or a text above the limits is refused naming the file, "
    "before allocation",
    "[common][flux][hostile]") {
  TempDir dir("flux-cache-limits");
  FluxCacheShape s = lorastream::testing::TinyCacheShape();
  // A 4096x4096 bucket: the name alone refuses it (the file is never read).
  WriteText(dir / "big_4096x4096_flux.npz", "not read");
  WriteText(dir / "big_flux_te.npz", "not read");
  std::string e = ErrorMessageOf([&] { ScanFluxCache(dir.str()); });
  CHECK_THAT(e, Catch::Contains("big_4096x4096_flux.npz"));
  CHECK_THAT(e, Catch::Contains("bucket 4096x4096 is above the limit of 2048 pixels a side"));
  // Digits stoll cannot hold are the same refusal, not "stoll".
  TempDir huge("flux-cache-huge");
  WriteText(huge / "h_99999999999999999999x0032_flux.npz", "");
  WriteText(huge / "h_flux_te.npz", "");
  CHECK_THAT(ErrorMessageOf([&] { ScanFluxCache(huge.str()); }),
             Catch::Contains("is above the limit of 2048"));

  // A T5 cache of 20,000 tokens: refused by its declared size before it is inflated.
  TempDir text("flux-cache-text");
  s.txt_len = 20000;
  lorastream::testing::WriteFluxCache(text.str(), "long", 32, 32, s, 1, /*compressed=*/true);
  const auto items = ScanFluxCache(text.str());
  e = ErrorMessageOf([&] { LoadFluxSample(items[0], 16, 48, 32); });
  CHECK_THAT(e, Catch::Contains(items[0].te_path));
  CHECK_THAT(e, Catch::Contains("exceeds the limit") || Catch::Contains("above the limit"));
  // With the widths of the file, the shape check names the rule.
  s = lorastream::testing::TinyCacheShape();
  s.context_dim = 4;
  s.txt_len = 1000;
  TempDir narrow("flux-cache-narrow");
  lorastream::testing::WriteFluxCache(narrow.str(), "n", 32, 32, s, 1);
  e = ErrorMessageOf([&] { LoadFluxSample(ScanFluxCache(narrow.str())[0], 16, 4, 32); });
  CHECK_THAT(e, Catch::Contains("t5_out` has 1000 text tokens, outside 1..512"));
  // An archive declaring more than its caller's limit is refused naming the member.
  NpyArray a = lorastream::testing::FloatArray({1000}, 1);
  WriteNpz(dir / "m.npz", {{"x", a}});
  e = ErrorMessageOf([&] { ReadNpz(dir / "m.npz", 2000); });
  CHECK_THAT(e, Catch::Contains("above the limit"));
  CHECK(ReadNpz(dir / "m.npz").at("x").numel() == 1000);
}

TEST_CASE("a FLUX checkpoint's block indices and metadata are checked by name before use",
          "[common][flux][hostile]") {
  TempDir dir("flux-names");
  const FluxConfig tiny = Tiny();
  // double_blocks.100000000.*: the index sized every later allocation (out of memory).
  const std::string huge = WriteBfl(dir / "huge.safetensors", tiny, [](const std::string& n) {
    return n == "double_blocks.1.img_mod.lin.bias" ? "double_blocks.100000000.img_mod.lin.bias" : n;
  });
  std::string e = ConfigError(huge);
  CHECK_THAT(e, Catch::Contains("tensor `double_blocks.100000000.img_mod.lin.bias`"));
  CHECK_THAT(e, Catch::Contains("block index 100000000 is not below"));
  // An index that is not a number: named, not "stoll".
  const std::string word = WriteBfl(dir / "word.safetensors", tiny, [](const std::string& n) {
    return n == "single_blocks.2.linear2.bias" ? "single_blocks.two.linear2.bias" : n;
  });
  e = ConfigError(word);
  CHECK_THAT(e, Catch::Contains("tensor `single_blocks.two.linear2.bias`: block index `two` is "
                                "not a number"));
  // RoPE axes and theta from the metadata: named keys, not a LibTorch arange error or "stod".
  const auto with_meta = [&](const std::string& name, const std::string& key,
                             const std::string& value) {
    return WriteBfl(dir / name, tiny, {}, [&](auto& m) { m[key] = value; });
  };
  e = ConfigError(with_meta("axes.safetensors", "flux.axes_dim", "-2,10,8"));
  CHECK_THAT(e, Catch::Contains("metadata `flux.axes_dim` `-2,10,8` is not three positive even"));
  e = ConfigError(with_meta("axes2.safetensors", "flux.axes_dim", "4,x,6"));
  CHECK_THAT(e, Catch::Contains("metadata `flux.axes_dim` `4,x,6`"));
  e = ConfigError(with_meta("theta.safetensors", "flux.theta", "ten thousand"));
  CHECK_THAT(e, Catch::Contains("metadata `flux.theta` `ten thousand` is not a number"));
  e = ConfigError(with_meta("theta2.safetensors", "flux.theta", "nan"));
  CHECK_THAT(e, Catch::Contains("metadata `flux.theta` `nan`"));
  FluxConfig deep = tiny;
  deep.depth = 100000000;
  CHECK_THAT(ErrorMessageOf([&] { deep.Validate("config.json"); }),
             Catch::Contains("above the limit of 1024"));
}

TEST_CASE("a FLUX job's every float key must be finite, and warmup_steps within the steps",
          "[common][flux][hostile]") {
  TempDir dir("flux-floats");
  FluxJob ok;
  ok.store = "flux";
  ok.cache_dir = dir.str();
  ok.output_dir = dir / "out";
  REQUIRE(FluxJobProblems(ok, "job.toml").empty());
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  const std::pair<const char*, double FluxJob::*> keys[] = {
      {"learning_rate", &FluxJob::learning_rate},
      {"weight_decay", &FluxJob::weight_decay},
      {"max_grad_norm", &FluxJob::max_grad_norm},
      {"alpha", &FluxJob::alpha},
      {"guidance", &FluxJob::guidance},
      {"sigmoid_scale", &FluxJob::sigmoid_scale},
      {"discrete_flow_shift", &FluxJob::discrete_flow_shift}};
  for (const auto& [key, member] : keys) {
    for (double bad : {nan, inf, -inf}) {
      FluxJob j = ok;
      j.*member = bad;
      const auto problems = FluxJobProblems(j, "job.toml");
      INFO(key << " = " << bad);
      REQUIRE_FALSE(problems.empty());
      CHECK_THAT(problems.front(), Catch::Contains(std::string("job.toml: key `flux.") + key +
                                                   "`: must be a finite number"));
    }
  }
  // The same from a job file: TOML's nan and inf.
  WriteText(dir / "nan.toml",
            "[flux]\nstore = \"flux\"\ncache_dir = \".\"\noutput_dir = \"o\"\n"
            "guidance = nan\n");
  CHECK_THAT(ErrorMessageOf([&] { LoadJobSpec(dir / "nan.toml"); }),
             Catch::Contains("key `flux.guidance`: must be a finite number (found nan)"));
  FluxJob warm = ok;
  warm.warmup_steps = std::numeric_limits<int64_t>::max();
  const auto problems = FluxJobProblems(warm, "job.toml");
  REQUIRE(problems.size() == 1);
  CHECK_THAT(problems[0], Catch::Contains("key `flux.warmup_steps`: must be in [0, flux.steps"));
  warm.warmup_steps = 101;
  CHECK(FluxJobProblems(warm, "job.toml").size() == 1);
  warm.warmup_steps = 100;
  CHECK(FluxJobProblems(warm, "job.toml").empty());
}

TEST_CASE("an LLM job's warmup_steps is bounded even when steps come from epochs",
          "[common][hostile]") {
  TempDir dir("llm-warmup");
  WriteText(dir / "d.jsonl", "{\"input_ids\": [1, 2, 3]}\n");
  JobSpec spec;
  spec.model.store = "s";
  spec.data.path = dir / "d.jsonl";
  spec.data.format = "jsonl";
  spec.train.epochs = 1;
  spec.train.output_dir = dir / "out";
  spec.optim.warmup_steps = std::numeric_limits<int64_t>::max();
  bool named = false;
  for (const std::string& p : ValidateJobSpec(spec))
    named = named || p.find("optim.warmup_steps") != std::string::npos;
  CHECK(named);
}

TEST_CASE("LibTorch's backtrace is cut from a message, leaving what went wrong",
          "[common][hostile]") {
  const std::string c10 =
      "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough memory: you "
      "tried to allocate 6402560256 bytes.\nException raised from alloc_cpu at "
      "alloc_cpu.cpp:117 (most recent call first):\nframe #0: c10::Error::Error() + 0x1\n"
      "frame #1: f() + 0x2\n";
  CHECK(WithoutBacktrace(c10) ==
        "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough memory: you "
        "tried to allocate 6402560256 bytes.");
  CHECK(WithoutBacktrace("a\nb\nframe #0: x") == "a\nb");
  CHECK(WithoutBacktrace("job refused:\n  one\n  two") == "job refused:\n  one\n  two");
}

TEST_CASE("a command's internal error prints LibTorch's message without its backtrace",
          "[common][hostile]") {
  TempDir dir("main-stderr");
  const std::string err = dir / "stderr";
  int code = 0;
  {
    // stderr into a file for the call (restored after).
    std::fflush(stderr);
    const int saved = ::dup(2);
    FILE* f = std::fopen(err.c_str(), "w");
    REQUIRE(f != nullptr);
    ::dup2(::fileno(f), 2);
    code = RunMainBody("lorastream-worker", []() -> int {
      throw std::runtime_error(
          "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough memory: "
          "you tried to allocate 6402560256 bytes.\nException raised from alloc_cpu at "
          "alloc_cpu.cpp:117 (most recent call first):\nframe #0: c10::Error::Error() + 0x1\n");
    });
    std::fflush(stderr);
    ::dup2(saved, 2);
    ::close(saved);
    std::fclose(f);
  }
  CHECK(code == 1);
  std::ifstream in(err);
  std::stringstream text;
  text << in.rdbuf();
  CHECK(text.str() ==
        "lorastream-worker: internal error: [enforce fail at alloc_cpu.cpp:117] data. "
        "DefaultCPUAllocator: not enough memory: you tried to allocate 6402560256 bytes.\n");
}
