// A tiny mixture-of-experts job trained by `lorastream-worker train` (the MoE and merge tests).
#pragma once

#include <cstdlib>
#include <fstream>
#include <string>

#include "torch_catch.h"  // Catch, after torch

#include "tests/support/test_support.h"
#include "worker_test_util.h"

namespace lorastream::testing {

// Writes DIR/job.toml over the checkpoint DIR/m and the data DIR/d.jsonl (LoRA rank 4 on the
// attention projections and every expert; `steps` steps, a checkpoint every 2, `swap` blocks
// streamed; learning rate `lr`, the job's default when 0) and trains it into `out` with
// `lorastream-worker train`; returns the adapter's bytes.
inline std::string TrainMoeCli(const TempDir& dir, const std::string& out, int steps, int swap,
                               double lr = 0) {
  {
    std::ofstream job(dir / "job.toml", std::ios::trunc);
    job << "name = \"moe\"\n[model]\ncheckpoint = \"" << (dir / "m") << "\"\n[data]\npath = \""
        << (dir / "d.jsonl") << "\"\nseq_len = 16\n[lora]\nrank = 4\n"
        << "targets = [\"q_proj\", \"k_proj\", \"v_proj\", \"o_proj\", \"experts\"]\n"
        << "[train]\nsteps = " << steps << "\ncheckpoint_every = 2\noutput_dir = \"" << out
        << "\"\n[stream]\nblocks_to_swap = " << swap << "\n";
    if (lr > 0) job << "[optim]\nlr = " << lr << "\n";
  }
  const std::string bin = std::string(LORASTREAM_BIN_DIR) + "/lorastream-worker";
  const std::string cmd =
      bin + " train " + (dir / "job.toml") + " --threads 1 > " + (dir / "log") + " 2>&1";
  const int rc = std::system(cmd.c_str());
  INFO(ReadFile(dir / "log"));
  REQUIRE(rc == 0);
  return ReadFile(out + "/adapter_model.safetensors");
}

}  // namespace lorastream::testing
