#include "worker/serve/parity.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <thread>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>

#include "common/base/device.h"
#include "common/base/error.h"
#include "common/base/log.h"
#include "common/formats/data.h"
#include "common/formats/safetensors.h"
#include "common/job/step_stats.h"
#include "worker/model/base_weights.h"
#include "worker/model/lora.h"
#include "worker/model/model.h"
#include "worker/model/torch_device.h"
#include "worker/stream/resident_provider.h"
#include "worker/train/adamw.h"
#include "worker/train/micro_batch_runner.h"

namespace lorastream::worker {

namespace fs = std::filesystem;

namespace {

at::Tensor ReadI64(const SafetensorsFile& file, const std::string& name) {
  const SafetensorsEntry* e = file.Find(name);
  if (!e) return at::Tensor();
  if (e->dtype != DType::kI64 || e->shape.size() != 2)
    throw Error(ErrorCode::kCorrupt, file.path() + ": `" + name + "` must be I64 [batch, seq]");
  return at::from_blob(const_cast<uint8_t*>(file.Data(*e)), e->shape, at::kLong).clone();
}

// The arithmetic of one training step in matmul FLOPs (the convention behind MFU): the
// frozen projections 6 per parameter per token (forward, recompute, input gradient), the LM
// head 4 per parameter per token (forward, input gradient), causal attention 2 S^2 D per head
// forward, counted twice for the forward and recompute and twice for the backward; the
// rank-r adapter terms are left out (under 1% at r = 16). A taped block skips the recompute:
// 4 per parameter per token, and attention's forward counted once.
double StepFlops(const ModelConfig& c, int64_t batch, int64_t seq, int taped_blocks) {
  const double h = static_cast<double>(c.hidden_size), d = static_cast<double>(c.head_dim);
  const double q = static_cast<double>(c.num_attention_heads) * d;
  const double kv = static_cast<double>(c.num_key_value_heads) * d;
  const double block =
      h * q + 2 * h * kv + q * h + 3 * h * static_cast<double>(c.intermediate_size);
  const double tokens = static_cast<double>(batch * seq), s = static_cast<double>(seq);
  const double attention = 2.0 * s * s * q * static_cast<double>(batch);
  const double taped = static_cast<double>(taped_blocks);
  return (static_cast<double>(c.num_hidden_layers) - taped) * (6 * block * tokens + 4 * attention) +
         taped * (4 * block * tokens + 3 * attention) +
         4 * h * static_cast<double>(c.vocab_size) * tokens;
}

// Where one step's time goes. Each phase runs once between two waits for the device: its
// wall time (GPU time, launch gaps included) and the host's time to issue it (until its
// calls return). A host time close to the phase's wall time means the phase is bound by
// launching kernels, not by the GPU.
nlohmann::json ProfileStep(CausalLm& model, const LoraAdapter& adapter, const at::Tensor& ids,
                           const at::Tensor& targets, int64_t n_targets, AdamW& optimizer,
                           double median_step) {
  using Clock = std::chrono::steady_clock;
  const std::vector<at::Tensor> params = adapter.Params();
  auto wait = [&] { (void)params.back().sum().item<double>(); };
  nlohmann::json phases = nlohmann::json::array();
  auto timed = [&](const char* name, const std::function<void()>& f) {
    wait();
    const auto t0 = Clock::now();
    f();
    const double host = std::chrono::duration<double>(Clock::now() - t0).count();
    wait();
    const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
    phases.push_back({{"phase", name}, {"wall_s", wall}, {"host_s", host}});
    return wall;
  };
  const double scale = 1.0 / static_cast<double>(std::max<int64_t>(1, n_targets));
  for (auto& p : params) p.mutable_grad() = at::Tensor();
  model.provider().BeginStep();
  at::Tensor hidden, loss;
  timed("forward (blocks)",
        [&] { hidden = model.Hidden(ids, adapter, /*training=*/true, /*checkpointed=*/true, 0); });
  timed("LM head + loss forward", [&] { loss = model.HeadLossSum(hidden, targets) * scale; });
  timed("backward (head + recompute + blocks)", [&] { loss.backward(); });
  StepStats stats;
  model.provider().EndStep(stats);  // the step's peak device memory (CUDA)
  timed("optimizer (AdamW)", [&] { optimizer.Step(1e-5); });
  // The head's own forward and backward, from a detached last hidden state.
  at::Tensor h = hidden.detach().requires_grad_(true);
  timed("LM head + loss forward + backward (alone)",
        [&] { (model.HeadLossSum(h, targets) * scale).backward(); });
  nlohmann::json j = {{"phases", phases},
                      {"flops", StepFlops(model.config(), ids.size(0), ids.size(1),
                                          model.provider().taped_blocks())},
                      {"taped_blocks", model.provider().taped_blocks()},
                      {"peak_device_bytes", stats.peak_device_bytes}};
  if (model.device().is_cuda() && model.dtype() == at::kBFloat16) {
    // The GPU's bf16 matmul rate through LibTorch, measured here (8192^3, 5 times).
    at::Tensor a =
        at::randn({8192, 8192}, at::TensorOptions().device(model.device()).dtype(at::kBFloat16));
    (void)at::mm(a, a).sum().item<double>();
    const auto t0 = Clock::now();
    at::Tensor c;
    for (int i = 0; i < 5; ++i) c = at::mm(a, a);
    (void)c.sum().item<double>();
    const double rate = 5 * 2.0 * 8192.0 * 8192.0 * 8192.0 /
                        std::chrono::duration<double>(Clock::now() - t0).count();
    j["gemm_flops_per_s"] = rate;
    j["mfu"] = j["flops"].get<double>() / (median_step * rate);
    j["floor_s"] = j["flops"].get<double>() / rate;
  }
  for (const auto& p : phases)
    LS_LOG_INFO("profile: {:<42} wall {:8.2f} ms  host {:8.2f} ms", p["phase"].get<std::string>(),
                1e3 * p["wall_s"].get<double>(), 1e3 * p["host_s"].get<double>());
  if (j.contains("mfu"))
    LS_LOG_INFO(
        "profile: {:.1f} TFLOP per step, GEMM rate {:.0f} TFLOP/s, floor {:.1f} ms, "
        "median step {:.1f} ms, MFU {:.1f}%, peak {:.2f} GiB",
        j["flops"].get<double>() / 1e12, j["gemm_flops_per_s"].get<double>() / 1e12,
        1e3 * j["floor_s"].get<double>(), 1e3 * median_step, 100 * j["mfu"].get<double>(),
        static_cast<double>(stats.peak_device_bytes) / (1ull << 30));
  return j;
}

}  // namespace

void RunParity(const ParityOptions& o) {
  at::set_num_threads(static_cast<int>(std::thread::hardware_concurrency()));
  const Device typed_device = ParseDevice(o.device);
  const c10::Device device = TorchDevice(typed_device);
  const std::optional<DType> compute = ParseShortDType(o.dtype);
  if (!compute || !IsComputeDType(*compute))
    throw Error(ErrorCode::kInvalidArgument, "--dtype must be f32 or bf16");
  const c10::ScalarType dtype = ScalarTypeOf(*compute, "the compute dtype");

  if (o.model_dir.empty() == o.store_name.empty())
    throw Error(ErrorCode::kInvalidArgument, "give one of --model and --store");
  BaseWeights base = o.store_name.empty() ? BaseWeights::FromCheckpoint(o.model_dir)
                                          : BaseWeights::FromStore(o.store_name);
  const ModelConfig& config = base.config();
  if (o.taped_blocks < -1 || o.taped_blocks > config.num_hidden_layers)
    throw Error(ErrorCode::kInvalidArgument, "--taped must be -1 (all), 0 or a block count up to " +
                                                 std::to_string(config.num_hidden_layers) +
                                                 " (found " + std::to_string(o.taped_blocks) + ")");
  ResidentProvider provider(base, device, dtype);
  const RestWeights rest = RestOnDevice(base.rest(), config, device, dtype);
  CausalLm model(config, rest, &provider, device, dtype);

  SafetensorsFile tokens = SafetensorsFile::Open(o.tokens_path);
  at::Tensor ids = ReadI64(tokens, "input_ids");
  if (!ids.defined()) throw Error(ErrorCode::kCorrupt, o.tokens_path + ": `input_ids` is missing");
  if (ids.min().item<int64_t>() < 0 || ids.max().item<int64_t>() >= config.vocab_size)
    throw Error(ErrorCode::kRefused, o.tokens_path + ": token ids outside the vocabulary");
  at::Tensor labels = ReadI64(tokens, "labels");
  if (!labels.defined()) labels = ids.clone();
  // transformers: pad labels with -100 on the right, shift left by one.
  at::Tensor targets = at::cat({labels.narrow(1, 1, labels.size(1) - 1),
                                at::full({labels.size(0), 1}, kIgnoreIndex, at::kLong)},
                               1);
  const int64_t n_targets = targets.ne(kIgnoreIndex).sum().item<int64_t>();
  ids = ids.to(device);
  targets = targets.to(device);

  LoraAdapter adapter = [&] {
    if (!o.adapter_dir.empty()) return LoraAdapter::Load(o.adapter_dir, config, device);
    LoraSettings s;
    s.rank = o.rank;
    s.alpha = 2.0 * static_cast<double>(o.rank);
    s.targets.fill(true);
    return LoraAdapter::Init(config, s, 0, device);
  }();

  // The parity pass: the whole sequence's logits, written out for the harness, and the
  // gradients of their mean cross entropy.
  fs::create_directories(o.out_dir);
  at::Tensor logits, loss;
  {
    provider.BeginStep();
    at::Tensor hidden = model.Hidden(ids, adapter, /*training=*/true, /*checkpointed=*/true, 0);
    const double scale = 1.0 / static_cast<double>(std::max<int64_t>(1, n_targets));
    at::Tensor full_logits = model.Logits(hidden);
    loss = CausalLm::LossSum(full_logits, targets) * scale;
    logits = full_logits.detach().to(at::kFloat);
    loss.backward();
    loss = loss.detach();
    StepStats stats;
    provider.EndStep(stats);
  }
  std::vector<at::Tensor> keep;
  std::vector<TensorToWrite> out;
  auto add = [&](const std::string& name, const at::Tensor& t) {
    keep.push_back(t.detach().to(at::kCPU, at::kFloat).contiguous());
    TensorToWrite w;
    w.name = name;
    w.dtype = DType::kF32;
    w.shape = keep.back().sizes().vec();
    w.data = keep.back().data_ptr();
    out.push_back(w);
  };
  add("logits", logits);
  add("loss", loss.reshape({1}));
  const auto params = adapter.Params();
  const auto names = adapter.ParamNames();
  for (size_t i = 0; i < params.size(); ++i) {
    if (!params[i].grad().defined())
      throw Error(ErrorCode::kInternal, "no gradient reached " + names[i]);
    add("grad." + names[i], params[i].grad());
  }
  WriteSafetensors((fs::path(o.out_dir) / "parity.safetensors").string(), out);
  logits = at::Tensor();  // written; the timed steps below must not carry it (peak memory)
  adapter.Save((fs::path(o.out_dir) / "adapter").string(), base.name_or_path());
  LS_LOG_INFO("parity: loss {:.6f} over {} targets, {} LoRA tensors -> {}", loss.item<double>(),
              n_targets, params.size(), o.out_dir);

  if (o.timing_repeats > 0) {
    provider.set_taped_blocks(o.taped_blocks < 0 ? provider.num_blocks() : o.taped_blocks);
    AdamW optimizer(params, AdamWOptions{});
    // The micro-batch as training runs it (worker/train/micro_batch_runner.h: a CUDA graph where
    // training would replay one).
    MicroBatchRunner runner(model, adapter, /*allow_graphs=*/true);
    optimizer.ZeroGrad();
    const at::Tensor divisor = model.LossDivisor(n_targets);
    std::vector<double> seconds;
    // Two warm-ups: the first runs eagerly, the second captures the graph where there is one.
    const int warmups = 2;
    for (int r = 0; r < o.timing_repeats + warmups; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      provider.BeginStep();
      at::Tensor l = runner.Run(model.Embed(ids), targets, divisor, 0);
      StepStats stats;
      provider.EndStep(stats);
      optimizer.Step(1e-5);
      runner.ZeroGrad(optimizer);
      (void)params.back().sum().item<double>();  // waits for the device's queue
      (void)l.item<double>();
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (r >= warmups) seconds.push_back(s);
    }
    std::vector<double> sorted = seconds;
    std::sort(sorted.begin(), sorted.end());
    nlohmann::json j = {
        {"step_seconds", seconds}, {"median_step_seconds", sorted[sorted.size() / 2]},
        {"tokens", ids.numel()},   {"dtype", o.dtype},
        {"device", o.device},      {"cuda_graph", runner.graphed()}};
    const double median = sorted[sorted.size() / 2];
    j["profile"] = ProfileStep(model, adapter, ids, targets, n_targets, optimizer, median);
    std::ofstream f(fs::path(o.out_dir) / "speed.json");
    f << j.dump(2) << "\n";
    LS_LOG_INFO("speed: median step {:.4f} s over {} steps", median, seconds.size());
  }
}

}  // namespace lorastream::worker
