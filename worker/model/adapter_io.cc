// peft's on-disk format for a causal-LM LoRA adapter: adapter_model.safetensors (keys
// base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_{A|B}.weight, A [r, in],
// B [out, r]), here, and adapter_config.json (LoraConfig.to_dict()), worker/model/peft_config.h.
#include <filesystem>
#include <set>
#include <sstream>

#include <ATen/ATen.h>

#include "common/base/error.h"
#include "common/formats/safetensors.h"
#include "common/job/job_spec.h"
#include "common/posix/durable_file.h"
#include "worker/model/base_weights.h"
#include "worker/model/lora.h"
#include "worker/model/peft_config.h"

namespace lorastream::worker {

namespace fs = std::filesystem;

void LoraAdapter::Save(const std::string& dir, const std::string& base_model) const {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw Error(ErrorCode::kIo, "cannot create " + dir + ": " + ec.message());
  std::vector<at::Tensor> host;  // keeps the CPU copies alive while writing
  std::vector<TensorToWrite> tensors;
  const auto names = ParamNames();
  const auto params = Params();
  for (size_t i = 0; i < params.size(); ++i) {
    host.push_back(params[i].detach().to(at::kCPU, at::kFloat).contiguous());
    TensorToWrite t;
    t.name = names[i];
    t.dtype = DType::kF32;
    t.shape = host.back().sizes().vec();
    t.data = host.back().data_ptr();
    tensors.push_back(t);
  }
  WriteSafetensors((fs::path(dir) / "adapter_model.safetensors").string(), tensors,
                   {{"format", "pt"}});

  WriteFileDurably((fs::path(dir) / "adapter_config.json").string(),
                   PeftConfigJson(settings_, base_model, &config_));
}

LoraAdapter LoraAdapter::Load(const std::string& dir, const ModelConfig& model,
                              c10::Device device) {
  const LoraSettings s = ReadPeftConfig((fs::path(dir) / "adapter_config.json").string());

  const std::string st_path = (fs::path(dir) / "adapter_model.safetensors").string();
  SafetensorsFile file = SafetensorsFile::Open(st_path);
  LoraAdapter a;
  a.config_ = model;
  a.settings_ = s;
  std::set<std::string> used;
  for (int64_t i = 0; i < model.num_hidden_layers; ++i) {
    LoraBlock blk;
    for (const LoraSlot& slot : LoraSlots(model, s, blk)) {
      for (bool is_b : {false, true}) {
        const std::string key = LoraModuleKey(static_cast<int>(i), slot.module, is_b);
        const SafetensorsEntry* e = file.Find(key);
        if (!e) throw Error(ErrorCode::kCorrupt, st_path + ": tensor `" + key + "` is missing");
        std::vector<int64_t> want =
            is_b ? std::vector<int64_t>{slot.out, s.rank} : std::vector<int64_t>{s.rank, slot.in};
        if (e->shape != want)
          throw Error(ErrorCode::kCorrupt,
                      st_path + ": tensor `" + key + "` has shape [" +
                          std::to_string(e->shape.size() > 0 ? e->shape[0] : -1) + ", ...] but [" +
                          std::to_string(want[0]) + ", " + std::to_string(want[1]) +
                          "] is expected");
        auto type = ScalarTypeOf(e->dtype, key);
        at::Tensor view = at::from_blob(const_cast<uint8_t*>(file.Data(*e)), want,
                                        at::TensorOptions().dtype(type));
        at::Tensor master = view.to(at::kFloat).clone().to(device).requires_grad_(true);
        *(is_b ? slot.b : slot.a) = master;
        used.insert(key);
      }
    }
    a.blocks_.push_back(std::move(blk));
  }
  for (const auto& e : file.tensors())
    if (!used.count(e.name))
      throw Error(ErrorCode::kUnsupported, st_path + ": unexpected tensor `" + e.name +
                                               "` (not a LoRA weight of this model and config)");
  return a;
}

namespace {

std::string Num(double v) {
  std::ostringstream s;
  s << v;
  return s.str();
}

std::string List(const std::vector<std::string>& names) {
  std::string s;
  for (const std::string& n : names) s += (s.empty() ? "" : ", ") + n;
  return "[" + s + "]";
}

// Every difference between the adapter's settings and the job's, naming both values.
std::vector<std::string> Mismatches(const LoraSettings& adapter, const LoraSettings& job,
                                    const std::string& dir) {
  std::vector<std::string> m;
  const std::string from = " but the adapter lora.init_from names (" + dir + ") has ";
  if (adapter.rank != job.rank)
    m.push_back("lora.rank is " + std::to_string(job.rank) + from + "rank " +
                std::to_string(adapter.rank) + " (adapter_config.json `r`)");
  if (adapter.alpha != job.alpha)
    m.push_back("lora.alpha is " + Num(job.alpha) + from + "alpha " + Num(adapter.alpha) +
                " (`lora_alpha`)");
  if (adapter.TargetNames() != job.TargetNames())
    m.push_back("lora.targets is " + List(job.TargetNames()) + from + "targets " +
                List(adapter.TargetNames()) + " (`target_modules`)");
  if (adapter.rslora != job.rslora)
    m.push_back(std::string("lora.rslora is ") + (job.rslora ? "true" : "false") + from +
                "use_rslora " + (adapter.rslora ? "true" : "false"));
  return m;
}

void RefuseMismatches(const std::vector<std::string>& m) {
  if (m.empty()) return;
  std::string text;
  for (const std::string& line : m) text += (text.empty() ? "" : "\n") + line;
  throw Error(ErrorCode::kRefused, text);
}

}  // namespace

void ApplyInitFrom(LoraSpec& spec) {
  if (spec.init_from.empty()) return;
  const LoraSettings a =
      ReadPeftConfig((fs::path(spec.init_from) / "adapter_config.json").string());
  if (spec.rank == 0) spec.rank = a.rank;
  if (spec.alpha == 0) spec.alpha = a.alpha;
  if (spec.targets.empty()) spec.targets = a.TargetNames();
  RefuseMismatches(Mismatches(a, LoraSettingsFromSpec(spec), spec.init_from));
}

LoraAdapter LoraAdapter::InitFrom(const std::string& dir, const ModelConfig& config,
                                  const LoraSettings& settings, c10::Device device) {
  LoraAdapter a = Load(dir, config, device);
  RefuseMismatches(Mismatches(a.settings(), settings, dir));
  a.settings_.dropout = settings.dropout;  // the job's: a training setting, not the adapter's
  return a;
}

}  // namespace lorastream::worker
