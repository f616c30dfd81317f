// lorastream-bench-stream: the streaming engine against fully resident training, in one run,
// through the trainer's real step (RunTraining). For each token count: a resident run, a run
// with --swap blocks streamed through --ring slots, and (at --budget-tokens) a run planned
// from --budget; plus the pinned H2D bandwidth of the store's blocks measured in the same run.
// Prints a table and writes OUT/bench_stream.md and OUT/bench_stream.jsonl.
//
//   lorastream-bench-stream --store NAME --out DIR [--device cuda:0] [--tokens 2048,8192]
//     [--swap 12] [--ring 2] [--budget 8GiB] [--budget-tokens 2048] [--steps 6] [--warmup 2]
//
// floor = max(resident step, H2D bytes per streamed step / measured bandwidth): what perfect
// overlap of the copies with compute would give.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "common/error.h"
#include "common/job_spec.h"
#include "common/log.h"
#include "common/remove_tree.h"
#include "store/attach.h"
#include "common/data.h"
#include "worker/stream_budget.h"
#include "worker/stream_engine.h"
#include "worker/stream_provider.h"
#include "worker/stream_stats.h"
#include "worker/trainer.h"
#ifdef LORASTREAM_HAVE_CUDA
#include "worker/cuda/cuda_bandwidth.h"
#endif

namespace fs = std::filesystem;
using namespace lorastream;

namespace {

struct BenchOptions {
  std::string store, out, device = "cuda:0";
  std::string scratch;  // data and run folders (adapters, checkpoints); removed at the end
  std::vector<int64_t> tokens = {2048, 8192};
  int64_t swap = 12, ring = 2, rank = 16, steps = 6, warmup = 2, budget_tokens = 2048;
  std::string budget = "8GiB";
};

struct Row {
  int64_t tokens = 0;
  std::string mode;
  int resident_blocks = 0, num_blocks = 0;
  double step_s = 0, h2d_gb = 0, busy_s = 0, stall_s = 0, peak_gib = 0, floor_s = 0;
  double floor2_s = 0;  // with every streamed block crossing twice per step (no reuse)
  double copies = 0, saved = 0, max_loss_diff = 0;
  std::vector<StepStats> stats;
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// Random token ids, one document per sequence, enough for every step.
std::string WriteData(const BenchOptions& o, int64_t tokens, int64_t vocab) {
  const std::string path = o.scratch + "/data-" + std::to_string(tokens) + ".tok";
  std::mt19937 rng(static_cast<uint32_t>(tokens));
  std::vector<Document> docs(o.steps + o.warmup + 2);
  for (auto& d : docs) {
    for (int64_t i = 0; i < tokens; ++i) d.ids.push_back(static_cast<int32_t>(rng() % vocab));
  }
  WriteTokenFile(path, docs, 4, false);
  return path;
}

JobSpec Spec(const BenchOptions& o, const std::string& data, int64_t tokens,
             const std::string& run) {
  JobSpec spec;
  spec.name = "bench-" + run;
  spec.model.store = o.store;
  spec.data.path = data;
  spec.data.seq_len = tokens;
  spec.data.packing = false;
  spec.lora.rank = o.rank;
  spec.optim.lr = 1e-5;
  spec.train.steps = o.steps + o.warmup;
  spec.train.output_dir = o.scratch + "/run-" + run;
  spec.train.dtype = o.device == "cpu" ? "f32" : "bf16";
  ResolveJobSpec(spec);
  return spec;
}

Row RunOne(const BenchOptions& o, const JobSpec& spec, bool streamed, const std::string& mode,
           int resident_blocks, int num_blocks) {
  TrainOptions t;
  t.device = o.device;
  t.resume = false;
  // Resident: the trainer's own ResidentProvider (it reports peak memory itself).
  if (streamed)
    t.make_provider = [](const JobSpec& j, const BaseWeights& b, const std::string& d,
                          const std::string& dt) { return MakeStreamProvider(j, b, d, dt); };
  Row row;
  row.tokens = spec.data.seq_len;
  row.mode = mode;
  row.resident_blocks = resident_blocks;
  row.num_blocks = num_blocks;
  std::fprintf(stderr, "bench: %s, %lld tokens ...\n", mode.c_str(),
               static_cast<long long>(row.tokens));
  RunTraining(spec, t, [&](const StepStats& s) { row.stats.push_back(s); });
  std::vector<double> step, gb, busy, stall, copies, saved;
  for (size_t i = o.warmup; i < row.stats.size(); ++i) {
    const StepStats& s = row.stats[i];
    step.push_back(s.step_seconds);
    gb.push_back(s.h2d_bytes / 1e9);
    busy.push_back(s.h2d_busy_seconds);
    stall.push_back(s.stall_seconds);
    copies.push_back(static_cast<double>(s.copies));
    saved.push_back(static_cast<double>(s.copies_saved));
    row.peak_gib = std::max(row.peak_gib, s.peak_device_bytes / double(1ULL << 30));
  }
  row.step_s = Median(step);
  row.h2d_gb = Median(gb);
  row.busy_s = Median(busy);
  row.stall_s = Median(stall);
  row.copies = Median(copies);
  row.saved = Median(saved);
  return row;
}

// GB/s of pinned H2D copies of the store's first blocks (CUDA), or of memcpy (CPU).
double MeasureBandwidth(const BenchOptions& o, const AttachedStore& store) {
  std::vector<std::pair<const uint8_t*, uint64_t>> ranges;
  for (int i = 0; i < std::min(4, store.num_blocks()); ++i) {
    ranges.push_back({store.block_data(i), store.block_size(i)});
  }
  if (o.device != "cpu") {
#ifdef LORASTREAM_HAVE_CUDA
    const c10::Device d(o.device == "cuda" ? std::string("cuda:0") : o.device);
    return MeasurePinnedH2DBandwidth(ranges, d.has_index() ? d.index() : 0, 5);
#else
    throw Error(ErrorCode::kUnsupported, "this build has no CUDA");
#endif
  }
  std::vector<uint8_t> dst(ranges[0].second);
  const auto t0 = std::chrono::steady_clock::now();
  uint64_t total = 0;
  for (int r = 0; r < 5; ++r) {
    for (const auto& [src, n] : ranges) {
      std::memcpy(dst.data(), src, std::min<uint64_t>(n, dst.size()));
      total += std::min<uint64_t>(n, dst.size());
    }
  }
  return total / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 1e9;
}

void Run(const BenchOptions& o, const std::string& command) {
  fs::create_directories(o.out);
  fs::create_directories(o.scratch);
  AttachedStore store = AttachedStore::Attach(o.store);
  const Manifest& m = store.manifest();
  const int L = store.num_blocks();
  const double gbps = MeasureBandwidth(o, store);
  std::fprintf(stderr, "bench: pinned H2D %.1f GB/s; block %.1f MB; %d blocks\n", gbps,
               m.blocks[0].nbytes / 1e6, L);

  std::vector<Row> rows;
  for (int64_t tokens : o.tokens) {
    const std::string data = WriteData(o, tokens, m.config.vocab_size);
    JobSpec resident = Spec(o, data, tokens, "resident-" + std::to_string(tokens));
    Row base = RunOne(o, resident, false, "resident", L, L);
    base.floor_s = base.step_s;
    base.floor2_s = base.step_s;
    const double block_gb = m.blocks[0].nbytes / 1e9;
    rows.push_back(base);

    JobSpec streamed = Spec(o, data, tokens, "swap-" + std::to_string(tokens));
    streamed.stream.blocks_to_swap = o.swap;
    streamed.stream.ring_size = o.ring;
    Row s = RunOne(o, streamed, true, "swap " + std::to_string(o.swap) + " ring " +
                   std::to_string(o.ring), L - static_cast<int>(o.swap), L);
    s.floor_s = std::max(base.step_s, s.h2d_gb / gbps);
    s.floor2_s = std::max(base.step_s, 2 * o.swap * block_gb / gbps);
    rows.push_back(s);

    if (tokens == o.budget_tokens && !o.budget.empty()) {
      JobSpec b = Spec(o, data, tokens, "budget-" + std::to_string(tokens));
      b.stream.gpu_memory_budget = ParseByteSize(o.budget, "--budget");
      b.stream.ring_size = o.ring;
      const bool cuda = o.device != "cpu";
      const MemoryModelInputs in = MemoryInputsFor(
          m, b.lora.rank, b.lora.targets, b.train.batch_size * tokens, cuda ? 2 : 4, !cuda);
      const ResidencyPlan plan = PlanResidency(0, b.stream.gpu_memory_budget, o.ring, in);
      Row r = RunOne(o, b, true, "budget " + o.budget, L - plan.num_streamed(), L);
      r.floor_s = std::max(base.step_s, r.h2d_gb / gbps);
      r.floor2_s = std::max(base.step_s, 2 * plan.num_streamed() * block_gb / gbps);
      rows.push_back(r);
    }
    for (Row& r : rows) {
      if (r.tokens != tokens || r.mode == "resident") continue;
      for (size_t i = 0; i < r.stats.size() && i < base.stats.size(); ++i) {
        r.max_loss_diff = std::max(r.max_loss_diff, std::abs(r.stats[i].loss - base.stats[i].loss));
      }
    }
  }

  std::ostringstream t;
  t << "# lorastream streaming benchmark\n\n`" << command << "`\n\n"
    << "store " << o.store << ": " << m.config.model_type << ", " << L << " blocks of "
    << m.blocks[0].nbytes / 1e6 << " MB, rank " << o.rank << " on all 7 projections, batch 1, "
    << "device " << o.device << "; median of " << o.steps << " steps after " << o.warmup
    << " warm-up steps; pinned H2D measured in this run: " << gbps << " GB/s\n\n"
    << "| tokens | mode | resident | step ms | vs resident | H2D GB/step | H2D busy ms | stall ms "
       "| copies (saved) | peak GiB | floor ms | vs floor | floor 2x ms | vs floor 2x "
       "| max loss diff |\n"
    << "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  double resident_step = 0;
  for (const Row& r : rows) {
    if (r.mode == "resident") resident_step = r.step_s;
    char line[512];
    std::snprintf(line, sizeof line,
                  "| %lld | %s | %d/%d | %.1f | %.3f | %.2f | %.1f | %.1f | %.0f (%.0f) | %.2f | "
                  "%.1f | %.3f | %.1f | %.3f | %.3g |\n",
                  static_cast<long long>(r.tokens), r.mode.c_str(), r.resident_blocks,
                  r.num_blocks, r.step_s * 1e3, r.step_s / resident_step, r.h2d_gb,
                  r.busy_s * 1e3, r.stall_s * 1e3, r.copies, r.saved, r.peak_gib,
                  r.floor_s * 1e3, r.step_s / r.floor_s, r.floor2_s * 1e3,
                  r.step_s / r.floor2_s, r.max_loss_diff);
    t << line;
  }
  t << "\nfloor = max(resident step, H2D bytes this step copied / bandwidth); floor 2x = "
       "max(resident step, 2 x streamed blocks x block bytes / bandwidth), i.e. without the "
       "engine's reuse of blocks still in a slot. max loss diff: against the resident run, "
       "step by step (bf16 on CUDA).\n";
  std::printf("%s", t.str().c_str());
  std::ofstream(o.out + "/bench_stream.md") << t.str();
  std::ofstream jsonl(o.out + "/bench_stream.jsonl");
  for (const Row& r : rows) {
    for (const StepStats& s : r.stats) {
      jsonl << "{\"tokens\":" << r.tokens << ",\"mode\":\"" << r.mode
            << "\",\"stats\":" << StepStatsJson(s) << "}\n";
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"lorastream-bench-stream: streamed vs resident training steps"};
  BenchOptions o;
  app.add_option("--store", o.store, "a store published by lorastream-store serve")->required();
  app.add_option("--out", o.out, "output folder")->required();
  app.add_option("--device", o.device, "cuda:N | cpu")->capture_default_str();
  app.add_option("--tokens", o.tokens, "sequence lengths (batch 1)")->delimiter(',');
  app.add_option("--swap", o.swap, "blocks streamed")->capture_default_str();
  app.add_option("--ring", o.ring, "ring slots")->capture_default_str();
  app.add_option("--rank", o.rank, "LoRA rank (all seven projections)")->capture_default_str();
  app.add_option("--budget", o.budget, "GPU memory budget of the budget run (\"\": none)");
  app.add_option("--budget-tokens", o.budget_tokens, "tokens of the budget run");
  app.add_option("--scratch", o.scratch, "folder for data and run outputs (default: a new one "
                 "in /tmp, removed at the end)");
  app.add_option("--steps", o.steps, "timed steps per run")->capture_default_str();
  app.add_option("--warmup", o.warmup, "untimed steps per run")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  InitLogging("bench-stream");
  std::string command;
  for (int i = 0; i < argc; ++i) command += (i ? " " : "") + std::string(argv[i]);
  const bool own_scratch = o.scratch.empty();
  if (own_scratch) o.scratch = "/tmp/lorastream-bench-stream-" + std::to_string(::getpid());
  int status = 0;
  try {
    Run(o, command);
  } catch (const Error& e) {
    std::fprintf(stderr, "lorastream-bench-stream: %s: %s\n", ErrorCodeName(e.code()), e.what());
    status = ExitCodeFor(e.code());
  }
  if (own_scratch) RemoveTree(o.scratch);
  return status;
}
