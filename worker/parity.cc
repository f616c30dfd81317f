#include "worker/parity.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <optional>
#include <thread>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>

#include "common/device.h"
#include "common/error.h"
#include "common/log.h"
#include "common/safetensors.h"
#include "worker/adamw.h"
#include "worker/base_weights.h"
#include "common/data.h"
#include "worker/lora.h"
#include "worker/model.h"
#include "worker/resident_provider.h"
#include "worker/torch_device.h"

namespace lorastream {

namespace fs = std::filesystem;

namespace {

at::Tensor ReadI64(const SafetensorsFile& file, const std::string& name) {
  const SafetensorsEntry* e = file.Find(name);
  if (!e) return at::Tensor();
  if (e->dtype != DType::kI64 || e->shape.size() != 2)
    throw Error(ErrorCode::kCorrupt, file.path() + ": `" + name + "` must be I64 [batch, seq]");
  return at::from_blob(const_cast<uint8_t*>(file.Data(*e)), e->shape, at::kLong).clone();
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

  BaseWeights base = BaseWeights::FromCheckpoint(o.model_dir);
  const ModelConfig& config = base.config();
  ResidentProvider provider(base, device, dtype);
  RestWeights rest;
  rest.embed_tokens = base.rest().embed_tokens.to(device, dtype);
  rest.norm = base.rest().norm.to(device, dtype);
  rest.lm_head = config.tie_word_embeddings ? rest.embed_tokens : base.rest().lm_head.to(device, dtype);
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
                                at::full({labels.size(0), 1}, kIgnoreIndex, at::kLong)}, 1);
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

  auto step = [&](bool keep_logits, at::Tensor* logits_out) {
    provider.BeginStep();
    at::Tensor hidden = model.Hidden(ids, adapter, /*training=*/true, /*checkpointed=*/true, 0);
    at::Tensor logits = model.Logits(hidden);
    at::Tensor loss = CausalLm::LossSum(logits, targets) / static_cast<double>(std::max<int64_t>(1, n_targets));
    if (keep_logits) *logits_out = logits.detach().to(at::kFloat);
    loss.backward();
    StepStats stats;
    provider.EndStep(stats);
    return loss.detach();
  };

  fs::create_directories(o.out_dir);
  at::Tensor logits;
  at::Tensor loss = step(true, &logits);
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
  adapter.Save((fs::path(o.out_dir) / "adapter").string(), o.model_dir);
  LS_LOG_INFO("parity: loss {:.6f} over {} targets, {} LoRA tensors -> {}", loss.item<double>(),
              n_targets, params.size(), o.out_dir);

  if (o.timing_repeats > 0) {
    AdamW optimizer(params, AdamWOptions{});
    std::vector<double> seconds;
    for (int r = 0; r <= o.timing_repeats; ++r) {
      for (auto& p : params) p.mutable_grad() = at::Tensor();
      const auto t0 = std::chrono::steady_clock::now();
      at::Tensor l = step(false, nullptr);
      optimizer.Step(1e-5);
      (void)params.back().sum().item<double>();  // waits for the device's queue
      (void)l.item<double>();
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (r > 0) seconds.push_back(s);  // r == 0 is the warm-up
    }
    std::vector<double> sorted = seconds;
    std::sort(sorted.begin(), sorted.end());
    nlohmann::json j = {{"step_seconds", seconds},
                        {"median_step_seconds", sorted[sorted.size() / 2]},
                        {"tokens", ids.numel()},
                        {"dtype", o.dtype},
                        {"device", o.device}};
    std::ofstream f(fs::path(o.out_dir) / "speed.json");
    f << j.dump(2) << "\n";
    LS_LOG_INFO("speed: median step {:.4f} s over {} steps", sorted[sorted.size() / 2],
                seconds.size());
  }
}

}  // namespace lorastream
