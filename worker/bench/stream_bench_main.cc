// lorastream-bench-stream: the streaming engine against fully resident training, in one run,
// through the trainer's real step (RunTraining). For each token count: a resident run, a run
// with every block resident and taped (stream.taped_blocks: no recompute in the backward), a
// run with --swap blocks streamed through --ring slots (one ring for the whole step), the same
// swap on the memory timeline at that plan's estimated peak (as many forward and backward
// slots and taped blocks as fit: stream.forward_slots = backward_slots = taped_blocks = -1),
// the cost model's choice with that plan's estimated peak as its budget, and at
// --budget-tokens the cost model's choice for --budget next to the best hand-picked
// (blocks_to_swap, ring_size) plan of each ring that fits the budget; plus the pinned H2D
// bandwidth of the store's blocks measured in the same run. Every streamed row shows the cost
// model's predicted step next to the measured one (figures calibrated once per token count on this
// device). Prints a table and writes OUT/bench_stream.md and OUT/bench_stream.jsonl.
//
//   lorastream-bench-stream --store NAME --out DIR [--device cuda:0] [--tokens 512,2048,8192]
//     [--swap 12] [--ring 2] [--budget 8GiB] [--budget-tokens 2048] [--steps 6] [--warmup 2]
//     [--hand-rings 4] [--phase-slots 3,4]
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
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "common/base/cli_main.h"
#include "common/base/device.h"
#include "common/base/error.h"
#include "common/base/log.h"
#include "common/formats/data.h"
#include "common/job/job_spec.h"
#include "common/posix/remove_tree.h"
#include "store/attach.h"
#include "worker/model/base_weights.h"
#include "worker/model/torch_device.h"
#include "worker/stream/stream_budget.h"
#include "worker/stream/stream_cost.h"
#include "worker/stream/stream_engine.h"
#include "worker/stream/stream_stats.h"
#include "worker/train/stream_calibrate.h"
#include "worker/train/stream_provider.h"
#include "worker/train/trainer.h"
#ifdef LORASTREAM_HAVE_CUDA
#include "worker/stream/cuda/cuda_bandwidth.h"
#include "worker/stream/cuda/cuda_memory.h"
#endif

namespace fs = std::filesystem;
using namespace lorastream;
using namespace lorastream::worker;

namespace {

struct BenchOptions {
  std::string store, out, device = "cuda:0";
  Device typed_device;  // `device`, parsed
  std::string scratch;  // data and run folders (adapters, checkpoints); removed at the end
  std::vector<int64_t> tokens = {512, 2048, 8192};
  int64_t swap = 12, ring = 2, rank = 16, steps = 6, warmup = 2, budget_tokens = 2048;
  int64_t hand_rings = 4;  // hand-picked plans at the budget: rings 1..hand_rings
  std::string budget = "8GiB";
  // The same swap with N slots in the forward and the backward (and as many across the LM
  // head as that plan's estimated peak holds), one row per N: bytes copied and the copy
  // engine's idle time against memory.
  std::vector<int64_t> phase_slots;
  // Only the resident row and the --swap/--ring row, without the cost model's calibration
  // (no predictions): the step ratios of several stores within little device time.
  bool quick = false;
};

struct Row {
  int64_t tokens = 0;
  std::string mode;
  int resident_blocks = 0, num_blocks = 0;
  double step_s = 0, h2d_gb = 0, busy_s = 0, stall_s = 0, peak_gib = 0, floor_s = 0;
  double floor2_s = 0;  // with every streamed block crossing twice per step (no reuse)
  double copies = 0, saved = 0, max_loss_diff = 0;
  double predicted_s = 0;   // the cost model's step; 0: none
  double estimate_gib = 0;  // the memory model's peak
  std::string slots;        // "2" or "2/7/6" (ring/forward/backward)
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
  spec.train.dtype = o.typed_device.is_cuda() ? "bf16" : "f32";
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
                         const std::string& dt, const std::vector<JobSpec>& group) {
      return MakeStreamProvider(j, b, d, dt, {}, group);
    };
  Row row;
  row.tokens = spec.data.seq_len;
  row.mode = mode;
  row.resident_blocks = resident_blocks;
  row.num_blocks = num_blocks;
  std::fprintf(stderr, "bench: %s, %lld tokens ...\n", mode.c_str(),
               static_cast<long long>(row.tokens));
#ifdef LORASTREAM_HAVE_CUDA
  // The allocator's driver calls during the row's steps (after the first, which allocates
  // everything once): a plan whose slots are freed and allocated again within a step should
  // find them in the cache, not call cudaMalloc.
  CudaAllocatorCounters before;
  int counted_from = -1;
  const int device_index = o.typed_device.is_cuda() ? o.typed_device.index : -1;
#endif
  RunTraining(spec, t, [&](const StepStats& s) {
    row.stats.push_back(s);
#ifdef LORASTREAM_HAVE_CUDA
    if (device_index >= 0 && counted_from < 0) {
      before = CudaAllocatorCountersNow(device_index);
      counted_from = static_cast<int>(row.stats.size());
    }
#endif
  });
#ifdef LORASTREAM_HAVE_CUDA
  if (device_index >= 0) {
    const CudaAllocatorCounters after = CudaAllocatorCountersNow(device_index);
    std::fprintf(
        stderr,
        "bench: %s, %lld tokens: in steps %d-%zu the allocator called cudaMalloc %lld "
        "times, cudaFree %lld, retried %lld, synced all streams %lld; %lld segments\n",
        mode.c_str(), static_cast<long long>(row.tokens), counted_from + 1, row.stats.size(),
        static_cast<long long>(after.device_allocs - before.device_allocs),
        static_cast<long long>(after.device_frees - before.device_frees),
        static_cast<long long>(after.retries - before.retries),
        static_cast<long long>(after.syncs - before.syncs), static_cast<long long>(after.segments));
  }
#endif
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
double MeasureBandwidth(const BenchOptions& o, const store::AttachedStore& store) {
  std::vector<std::pair<const uint8_t*, uint64_t>> ranges;
  for (int i = 0; i < std::min(4, store.num_blocks()); ++i) {
    ranges.push_back({store.block_data(i), store.block_size(i)});
  }
  if (o.typed_device.is_cuda()) {
#ifdef LORASTREAM_HAVE_CUDA
    return MeasurePinnedH2DBandwidth(ranges, o.typed_device.index, 5);
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

// The plan a streamed spec gets (the provider plans the same way), its cost-model prediction
// and memory estimate, filled into the row.
void Predict(const JobSpec& spec, const BaseWeights& base, const MemoryModelInputs& in,
             const StepCosts& costs, const c10::Device& device, c10::ScalarType dtype, Row* row) {
  const StreamPlanning p = PlanJobStream(spec, base, in, device, dtype);
  row->predicted_s = PredictStep(p.plan, in.block_bytes, costs, in.head_bytes).step_seconds;
  row->estimate_gib = EstimateMemory(in, p.plan).total() / double(1ULL << 30);
  row->resident_blocks = p.plan.num_blocks() - p.plan.num_streamed();
  row->slots = std::to_string(p.plan.ring_size);
  if (p.plan.max_slots() != p.plan.ring_size)
    row->slots += "/" + std::to_string(p.plan.forward_slots) + "/" +
                  std::to_string(p.plan.head_slots) + "/" + std::to_string(p.plan.backward_slots);
  if (p.plan.taped_blocks > 0) row->slots += ", " + std::to_string(p.plan.taped_blocks) + " taped";
}

void Run(const BenchOptions& o, const std::string& command) {
  fs::create_directories(o.out);
  fs::create_directories(o.scratch);
  store::AttachedStore store = store::AttachedStore::Attach(o.store);
  const Manifest& m = store.manifest();
  const int L = store.num_blocks();
  const double gbps = MeasureBandwidth(o, store);
  std::fprintf(stderr, "bench: pinned H2D %.1f GB/s; block %.1f MB; %d blocks\n", gbps,
               m.blocks[0].nbytes / 1e6, L);
  const c10::Device device = TorchDevice(o.typed_device);
  const c10::ScalarType dtype = device.is_cuda() ? at::kBFloat16 : at::kFloat;

  std::vector<Row> rows;
  for (int64_t tokens : o.tokens) {
    const std::string data = WriteData(o, tokens, m.config.vocab_size);
    JobSpec resident = Spec(o, data, tokens, "resident-" + std::to_string(tokens));
    const BaseWeights base = BaseWeights::ForJob(resident);
    const MemoryModelInputs in =
        JobMemoryInputs(resident, ComputeLayout(base, dtype), device, dtype);
    // Measured again for every bench run (not from the cache): the figures of this run.
    StepCosts costs;
    if (!o.quick) {
      costs = MeasureStepCosts(resident, base, device, dtype);
      SaveStepCosts(CalibrationKey(resident, base, device, dtype), costs);
      std::fprintf(stderr, "bench: %lld tokens: %s\n", static_cast<long long>(tokens),
                   costs.Describe().c_str());
    }

    Row res = RunOne(o, resident, false, "resident", L, L);
    res.floor_s = res.step_s;
    res.floor2_s = res.step_s;
    res.predicted_s = o.quick ? 0.0 : costs.ResidentStepSeconds(L);
    res.slots = "-";
    const double block_gb = m.blocks[0].nbytes / 1e9;
    rows.push_back(res);

    auto streamed_row = [&](const std::string& run, const std::string& mode,
                            const std::function<void(JobSpec&)>& set) {
      JobSpec spec = Spec(o, data, tokens, run + "-" + std::to_string(tokens));
      set(spec);
      Row probe;
      if (o.quick) {
        const ResidencyPlan plan =
            PlanFromSwapCount(L, static_cast<int>(spec.stream.blocks_to_swap),
                              static_cast<int>(spec.stream.ring_size));
        probe.resident_blocks = L - plan.num_streamed();
        probe.estimate_gib = EstimateMemory(in, plan).total() / double(1ull << 30);
        probe.slots = std::to_string(spec.stream.ring_size);
      } else {
        Predict(spec, base, in, costs, device, dtype, &probe);
      }
      Row r = RunOne(o, spec, true, mode, probe.resident_blocks, L);
      r.predicted_s = probe.predicted_s;
      r.estimate_gib = probe.estimate_gib;
      r.slots = probe.slots;
      r.floor_s = std::max(res.step_s, r.h2d_gb / gbps);
      r.floor2_s = std::max(res.step_s, 2 * (L - r.resident_blocks) * block_gb / gbps);
      rows.push_back(r);
    };
    // Each row's largest loss difference against the resident run, step by step.
    auto loss_diffs = [&] {
      for (Row& r : rows) {
        if (r.tokens != tokens || r.mode == "resident") continue;
        for (size_t i = 0; i < r.stats.size() && i < res.stats.size(); ++i)
          r.max_loss_diff =
              std::max(r.max_loss_diff, std::abs(r.stats[i].loss - res.stats[i].loss));
      }
    };
    const std::string today = "swap " + std::to_string(o.swap) + " ring " + std::to_string(o.ring);
    if (o.quick) {
      streamed_row("swap", today, [&](JobSpec& s) {
        s.stream.blocks_to_swap = o.swap;
        s.stream.ring_size = o.ring;
      });
      loss_diffs();
      continue;
    }
    // Every block resident and taped: no recompute in the backward (what the checkpoints
    // cost), at the memory of every block's activations.
    streamed_row("taped", "resident, " + std::to_string(L) + " taped", [&](JobSpec& s) {
      s.stream.blocks_to_swap = 0;
      s.stream.taped_blocks = L;
    });
    streamed_row("swap", today, [&](JobSpec& s) {
      s.stream.blocks_to_swap = o.swap;
      s.stream.ring_size = o.ring;
    });
    streamed_row("timeline", today + " timeline", [&](JobSpec& s) {
      s.stream.blocks_to_swap = o.swap;
      s.stream.ring_size = o.ring;
      s.stream.forward_slots = -1;
      s.stream.backward_slots = -1;
      s.stream.taped_blocks = -1;
    });
    // The cost model's choice within the same estimated peak: any resident set, ring, slots,
    // tapes and LM head placement that fits where this plan does.
    const uint64_t today_peak = EstimateMemory(in, PlanFromSwapCount(L, o.swap, o.ring)).total();
    try {
      streamed_row("peak", "cost model within " + today + "'s peak", [&](JobSpec& s) {
        s.stream.gpu_memory_budget = today_peak;
        s.stream.ring_size = o.ring;
      });
    } catch (const Error& e) {
      std::fprintf(stderr, "bench: the cost model within %s's peak at %lld tokens: %s\n",
                   today.c_str(), static_cast<long long>(tokens), e.what());
    }
    for (int64_t n : o.phase_slots) {
      streamed_row("slots", today + " slots " + std::to_string(n), [&](JobSpec& s) {
        s.stream.blocks_to_swap = o.swap;
        s.stream.ring_size = o.ring;
        s.stream.forward_slots = n;
        s.stream.backward_slots = n;
      });
    }

    if (tokens == o.budget_tokens && !o.budget.empty()) {
      const uint64_t budget = ParseByteSize(o.budget, "--budget");
      try {
        streamed_row("budget", "budget " + o.budget + " (cost model)", [&](JobSpec& s) {
          s.stream.gpu_memory_budget = budget;
          s.stream.ring_size = o.ring;
        });
      } catch (const Error& e) {
        std::fprintf(stderr, "bench: budget %s at %lld tokens: %s\n", o.budget.c_str(),
                     static_cast<long long>(tokens), e.what());
      }
      // The best hand-picked plan of each ring: the fewest streamed blocks that fit.
      for (int ring = 1; ring <= o.hand_rings; ++ring) {
        for (int swap = 0; swap <= L; ++swap) {
          if (EstimateMemory(in, PlanFromSwapCount(L, swap, ring)).total() > budget) continue;
          if (swap > 0 && swap < ring) continue;  // the same as a smaller ring
          streamed_row("hand-" + std::to_string(ring),
                       "hand swap " + std::to_string(swap) + " ring " + std::to_string(ring),
                       [&](JobSpec& s) {
                         s.stream.blocks_to_swap = swap;
                         s.stream.ring_size = ring;
                       });
          break;
        }
      }
    }
    loss_diffs();
  }

  std::ostringstream t;
  t << "# lorastream streaming benchmark\n\n`" << command << "`\n\n"
    << "store " << o.store << ": " << m.config.model_type << ", " << L << " blocks of "
    << m.blocks[0].nbytes / 1e6 << " MB, rank " << o.rank << " on all 7 projections, batch 1, "
    << "device " << o.device << "; median of " << o.steps << " steps after " << o.warmup
    << " warm-up steps; pinned H2D measured in this run: " << gbps << " GB/s\n\n"
    << "| tokens | mode | resident | slots (ring/fwd/head/bwd) | step ms | vs resident | predicted "
       "ms "
       "| measured / predicted | H2D GB/step | H2D busy ms | stall ms | copies (saved) "
       "| peak GiB | estimate GiB | floor ms | vs floor | floor 2x ms | vs floor 2x "
       "| max loss diff |\n"
    << "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  double resident_step = 0;
  for (const Row& r : rows) {
    if (r.mode == "resident") resident_step = r.step_s;
    char line[768];
    std::snprintf(line, sizeof line,
                  "| %lld | %s | %d/%d | %s | %.1f | %.3f | %.1f | %.3f | %.2f | %.1f | %.1f "
                  "| %.0f (%.0f) | %.2f | %.2f | %.1f | %.3f | %.1f | %.3f | %.3g |\n",
                  static_cast<long long>(r.tokens), r.mode.c_str(), r.resident_blocks, r.num_blocks,
                  r.slots.c_str(), r.step_s * 1e3, r.step_s / resident_step, r.predicted_s * 1e3,
                  r.predicted_s > 0 ? r.step_s / r.predicted_s : 0.0, r.h2d_gb, r.busy_s * 1e3,
                  r.stall_s * 1e3, r.copies, r.saved, r.peak_gib, r.estimate_gib, r.floor_s * 1e3,
                  r.step_s / r.floor_s, r.floor2_s * 1e3, r.step_s / r.floor2_s, r.max_loss_diff);
    t << line;
  }
  t << "\nslots: ring (kept the whole step) / forward / across the LM head / backward (the memory "
       "timeline). "
       "predicted: the cost model (worker/stream/stream_cost.h) from figures measured in this run. "
       "estimate: the memory model's peak (worker/stream/stream_budget.h); peak: measured.\n"
       "floor = max(resident step, H2D bytes this step copied / bandwidth); floor 2x = "
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
  app.add_option("--hand-rings", o.hand_rings,
                 "hand-picked plans at the budget: the best of each ring 1..N")
      ->capture_default_str();
  app.add_option("--phase-slots", o.phase_slots,
                 "extra rows: the same swap with N forward and backward slots, for each N")
      ->delimiter(',');
  app.add_option("--scratch", o.scratch,
                 "folder for data and run outputs (default: a new one "
                 "in /tmp, removed at the end)");
  app.add_flag("--quick", o.quick,
               "only the resident and the --swap/--ring rows, without calibration");
  app.add_option("--steps", o.steps, "timed steps per run")->capture_default_str();
  app.add_option("--warmup", o.warmup, "untimed steps per run")->capture_default_str();
  return RunMain("lorastream-bench-stream", app, argc, argv, [&] {
    InitLogging("bench-stream");
    o.typed_device = ParseDevice(o.device);
    std::string command;
    for (int i = 0; i < argc; ++i) command += (i ? " " : "") + std::string(argv[i]);
    const bool own_scratch = o.scratch.empty();
    if (own_scratch) o.scratch = "/tmp/lorastream-bench-stream-" + std::to_string(::getpid());
    try {
      Run(o, command);
    } catch (...) {
      if (own_scratch) RemoveTree(o.scratch);  // a failed run leaves nothing behind either
      throw;
    }
    if (own_scratch) RemoveTree(o.scratch);
    return 0;
  });
}
