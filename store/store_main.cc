// lorastream-store: serve | inspect | ls | verify | dequantize. Parses options, calls one Run
// function.
#include <iostream>

#include <CLI/CLI.hpp>

#include "common/base/cli_main.h"
#include "common/base/error.h"
#include "common/base/log.h"
#include "store/commands.h"
#include "store/dequantize.h"
#include "store/inspect.h"
#include "store/server.h"

int main(int argc, char** argv) {
  using namespace lorastream;
  using namespace lorastream::store;
  CLI::App app{"lorastream-store: one shared, read-only copy of a model's base weights"};
  app.require_subcommand(1);
  store::ServeOptions serve;
  std::string dtype = "keep", quantize = "none", mode = "0600", path, name, level = "info";
  int verify_threads = 0;
  app.add_option("--log-level", level, "trace|debug|info|warn|error");
  auto* s = app.add_subcommand(
      "serve", "load, pack, lock and publish a checkpoint; stay up until SIGTERM/SIGINT");
  s->add_option("model_dir", serve.model_dir,
                "a language model's Hugging Face folder; a FLUX.1 checkpoint (BFL's single file "
                "or a diffusers folder); a Qwen-Image one (ComfyUI's single file, bf16 or "
                "fp8_e4m3fn, or a diffusers folder)")
      ->required();
  s->add_option("--name", serve.name, "store name ([A-Za-z0-9_-], at most 64)")->required();
  s->add_option("--dtype", dtype, "keep | bf16 (convert F32/F16 to BF16)")
      ->check(CLI::IsMember({"keep", "bf16"}));
  s->add_option("--threads", serve.threads, "loader threads (0: all cores)");
  s->add_option("--mode", mode, "segment permissions, octal (default owner-only 0600)");
  s->add_option("--quantize", quantize,
                "none | fp8 (e4m3, 128x128 block scales) | nf4 (bitsandbytes NF4): the blocks' "
                "projection weights stored compressed")
      ->check(CLI::IsMember({"none", "fp8", "nf4"}));
  s->add_flag("--quantize-head", serve.quantize_head,
              "with --quantize: the LM head stored in that format too (a tied model's one table, "
              "which is the embedding too), expanded per vocabulary slice by the worker");
  s->add_flag("--quantize-embedding", serve.quantize_embedding,
              "with --quantize: the embedding table stored in that format too (its rows expanded "
              "on the host per batch; a tied model's one table, as --quantize-head)");
  s->add_flag("!--no-lock", serve.lock, "do not mlock the segments");
  s->add_flag("!--no-huge-pages", serve.huge_pages, "do not ask for transparent huge pages");
  auto* i = app.add_subcommand(
      "inspect", "validate a .safetensors file or checkpoint folder and list its tensors");
  i->add_option("path", path)->required();
  app.add_subcommand("ls", "list stores, segments, bytes and attached processes");
  auto* v = app.add_subcommand("verify", "re-check every checksum through a read-only attach");
  v->add_option("--name", name)->required();
  v->add_option("--threads", verify_threads, "hashing threads (0: all cores)");
  bool verify_hold = false;
  v->add_flag("--hold", verify_hold,
              "then stay attached until SIGTERM/SIGINT (a reader, for measuring memory)");
  store::DequantizeOptions dequantize;
  std::string dequantize_format = "none";
  auto* d = app.add_subcommand(
      "dequantize",
      "write a compressed base back as a plain checkpoint: the bf16 weights the worker computes "
      "with (for parity and quality checks)");
  d->add_option("model_dir", dequantize.model_dir,
                "Hugging Face checkpoint folder (plain with --quantize, or pre-quantised)")
      ->required();
  d->add_option("--out", dequantize.out_dir, "new folder for the dequantised checkpoint")
      ->required();
  d->add_option("--quantize", dequantize_format, "none (a pre-quantised folder) | fp8 | nf4")
      ->check(CLI::IsMember({"none", "fp8", "nf4"}));
  d->add_flag("--quantize-head", dequantize.quantize_head, "as serve's");
  d->add_flag("--quantize-embedding", dequantize.quantize_embedding, "as serve's");
  d->add_option("--threads", dequantize.threads, "threads (0: all cores)");
  return RunMain("lorastream-store", app, argc, argv, [&] {
    InitLogging("store", level);
    if (*s) {
      serve.to_bf16 = dtype == "bf16";
      serve.quantize = *ParseQuantMethod(quantize);
      size_t used = 0;
      try {
        serve.mode = static_cast<mode_t>(std::stoul(mode, &used, 8));
      } catch (const std::logic_error&) {
        used = 0;
      }
      if (used == 0 || used != mode.size() || serve.mode > 0777)
        throw Error(ErrorCode::kInvalidArgument, "--mode `" + mode + "` is not an octal mode");
      return store::RunServe(serve);
    }
    if (*i)
      RunInspect(path, std::cout);
    else if (app.got_subcommand("ls"))
      RunLs(std::cout);
    else if (*v)
      RunVerify(name, verify_threads, std::cout, verify_hold);
    else if (*d) {
      dequantize.quantize = *ParseQuantMethod(dequantize_format);
      const DequantizeResult r = WriteDequantized(dequantize);
      std::cout << dequantize.out_dir << ": " << r.expanded_tensors << " weights of "
                << DescribeQuant(r.format) << " written as bf16\n";
    }
    return 0;
  });
}
