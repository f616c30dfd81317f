// `lorastream-worker quant-report JOB.toml`: how close a compressed base (fp8, nf4) comes to
// the bf16 base of the same checkpoint. The job names the checkpoint ([model] checkpoint), the
// data, an evaluation set ([eval]) and a short training run; for each format the checkpoint
// is packed into a private store (bf16, `--quantize` as asked) that lives only during the
// report, and the report measures:
//   - weight SQNR, 10 log10(sum w^2 / sum (w - expand(w))^2) over the bf16 weights, per
//     projection kind (q_proj ... down_proj) and over all of them;
//   - the KL divergence KL(p_bf16 || p_format) of the next-token distributions of the base
//     models (no adapter) on the first eval batches, in nats per token (mean and max over
//     tokens), and each model's own eval loss there;
//   - the eval loss after the job's training run on each base (the same seed, data and
//     schedule), against the bf16 base's run;
//   - the time to expand one block's projections on the device (each use of a compressed
//     block costs one).
// Printed as a table and written as JSON (`--out`). Torch-free header.
#pragma once

#include <string>

namespace lorastream::worker {

struct QuantReportOptions {
  std::string job_path;
  std::string device = "cpu";       // cpu | cuda:N
  std::string formats = "fp8,nf4";  // compared against bf16, in this order
  int kl_batches = 2;               // eval batches of train.batch_size sequences for the KL
  int threads = 0;                  // store packing threads; 0: every core
  std::string out_path;             // JSON; "" = none
};

// Returns 0; throws Error naming what is wrong (kInvalidArgument / kRefused for a job without
// [eval] or without a checkpoint folder, an unknown format).
int RunQuantReport(const QuantReportOptions& options);

}  // namespace lorastream::worker
