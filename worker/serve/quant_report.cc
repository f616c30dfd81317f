#include "worker/serve/quant_report.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <nlohmann/json.hpp>

#include "common/base/device.h"
#include "common/base/error.h"
#include "common/base/format_bytes.h"
#include "common/base/log.h"
#include "common/formats/data.h"
#include "common/job/job_data.h"
#include "common/job/job_spec.h"
#include "common/job/step_stats.h"
#include "store/server.h"
#include "worker/model/base_weights.h"
#include "worker/model/lora.h"
#include "worker/model/model.h"
#include "worker/model/quant_expand.h"
#include "worker/model/torch_device.h"
#include "worker/stream/resident_provider.h"
#include "worker/train/trainer.h"

namespace lorastream::worker {

namespace {

const char* const kKinds[] = {"q_proj",    "k_proj",  "v_proj",   "o_proj",
                              "gate_proj", "up_proj", "down_proj"};

// "self_attn.q_proj.weight" -> "q_proj".
std::string KindOf(const std::string& name) {
  const size_t end = name.rfind(".weight");
  const size_t begin = name.rfind('.', end - 1) + 1;
  return name.substr(begin, end - begin);
}

std::unique_ptr<store::PublishedStore> Pack(const QuantReportOptions& o, const JobSpec& job,
                                            QuantMethod method) {
  store::ServeOptions s;
  s.model_dir = job.model.checkpoint;
  s.name = "quant-report-" + std::to_string(::getpid()) + "-" + QuantMethodName(method);
  s.to_bf16 = true;  // the bf16 base the formats are measured against, and theirs
  s.threads = o.threads;
  s.lock = false;  // lives for the report only
  s.quantize = method;
  auto store = store::PublishedStore::Build(s);
  LS_LOG_INFO("quant-report: {} packed in {:.1f} s ({:.2f} GB)", store->manifest().store_name,
              store->report().total_seconds, store->report().bytes / 1e9);
  return store;
}

uint64_t BlockBytes(const Manifest& m) {
  uint64_t bytes = 0;
  for (const SegmentInfo& b : m.blocks) bytes += b.nbytes;
  return bytes;
}

// Weight SQNR of every compressed projection of `q` against the same weight of `plain` (both
// expanded and compared on `device`): per kind, and "all".
nlohmann::json WeightSqnr(const BaseWeights& plain, const BaseWeights& q, c10::Device device) {
  std::map<std::string, std::pair<double, double>> sums;  // kind -> (signal, noise)
  const Manifest& m = *q.manifest();
  c10::NoGradGuard no_grad;
  for (int i = 0; i < q.num_blocks(); ++i) {
    const SegmentInfo& layout = m.blocks[i];
    const at::Tensor bytes =
        at::from_blob(const_cast<uint8_t*>(q.block_bytes()[i]),
                      {static_cast<int64_t>(layout.nbytes)}, at::TensorOptions().dtype(at::kByte))
            .to(device);
    for (const TensorSlice& t : layout.tensors) {
      if (!t.quant.compressed()) continue;
      const at::Tensor* ref = BlockWeightField(plain.block(i), t.name);
      LS_CHECK(ref != nullptr, "the bf16 store lacks " + t.name);
      const at::Tensor r = ref->to(device, at::kFloat);
      const at::Tensor e = ExpandWeight(bytes, layout, t).to(at::kFloat);
      const double signal = r.square().sum(at::kDouble).item<double>();
      const double noise = (e - r).square().sum(at::kDouble).item<double>();
      for (const std::string& key : {KindOf(t.name), std::string("all")}) {
        sums[key].first += signal;
        sums[key].second += noise;
      }
    }
  }
  nlohmann::json j;
  for (const auto& [kind, s] : sums)
    j[kind] = s.second > 0 ? 10 * std::log10(s.first / s.second)
                           : std::numeric_limits<double>::infinity();
  return j;
}

// The base model's (no adapter) log-probabilities on `batches`, f32 on the device, and its
// mean cross entropy over their targets.
struct BaseOutputs {
  std::vector<at::Tensor> log_probs;  // [B, S, vocab] per batch
  double loss = 0;
};
BaseOutputs RunBase(const BaseWeights& base, const std::vector<Batch>& batches, c10::Device device,
                    c10::ScalarType dtype) {
  c10::NoGradGuard no_grad;
  const ModelConfig& c = base.config();
  ResidentProvider provider(base, device, dtype);
  const RestWeights rest = RestOnDevice(base.rest(), c, device, dtype);
  CausalLm model(c, rest, &provider, device, dtype);
  LoraSettings s;
  s.rank = 1;
  s.alpha = 1;
  s.targets.fill(true);
  const LoraAdapter none = LoraAdapter::Init(c, s, 0, device);  // B = 0: the base alone
  BaseOutputs out;
  double loss_sum = 0;
  int64_t targets = 0;
  provider.BeginStep();
  for (const Batch& b : batches) {
    const auto options = at::TensorOptions().dtype(at::kLong);
    const at::Tensor ids =
        at::from_blob(const_cast<int64_t*>(b.ids.data()), {b.rows, b.seq_len}, options).to(device);
    const at::Tensor t =
        at::from_blob(const_cast<int64_t*>(b.targets.data()), {b.rows, b.seq_len}, options)
            .to(device);
    const at::Tensor logits =
        model.Logits(model.Hidden(ids, none, /*training=*/false, /*checkpointed=*/false, 0));
    loss_sum += CausalLm::LossSum(logits, t).item<double>();
    targets += b.n_targets;
    out.log_probs.push_back(at::log_softmax(logits.to(at::kFloat), -1));
  }
  StepStats stats;
  provider.EndStep(stats);
  out.loss = loss_sum / static_cast<double>(std::max<int64_t>(1, targets));
  return out;
}

// KL(p || q) per token, in nats: mean and max over every position of every batch.
std::pair<double, double> KlDivergence(const BaseOutputs& p, const BaseOutputs& q) {
  double sum = 0, max = 0;
  int64_t tokens = 0;
  for (size_t i = 0; i < p.log_probs.size(); ++i) {
    const at::Tensor kl = (p.log_probs[i].exp() * (p.log_probs[i] - q.log_probs[i])).sum(-1);
    sum += kl.sum(at::kDouble).item<double>();
    max = std::max(max, kl.max().item<double>());
    tokens += kl.numel();
  }
  return {sum / static_cast<double>(std::max<int64_t>(1, tokens)), max};
}

// The job's training run on store `store_name`: the eval loss after its last step.
double TrainedEvalLoss(const JobSpec& job, const QuantReportOptions& o,
                       const std::string& store_name, const std::string& tag) {
  JobSpec spec = job;
  spec.model.checkpoint.clear();
  spec.model.store = store_name;
  spec.train.output_dir = job.train.output_dir + "/quant-report-" + tag;
  spec.train.stats_file.clear();
  TrainOptions t;
  t.device = o.device;
  t.resume = false;
  const TrainResult r = RunTraining(spec, t);
  return r.final_eval_loss;
}

}  // namespace

int RunQuantReport(const QuantReportOptions& o) {
  const JobSpec job = LoadJobSpec(o.job_path);
  if (job.model.checkpoint.empty())
    throw Error(ErrorCode::kRefused,
                o.job_path +
                    ": [model] must name a checkpoint folder (the report packs it itself, "
                    "once in bf16 and once per format)");
  if (!job.eval.enabled())
    throw Error(ErrorCode::kRefused,
                o.job_path + ": the report needs an evaluation set: give [eval] path or split");
  std::vector<QuantMethod> methods;
  for (size_t at = 0; at <= o.formats.size();) {
    const size_t comma = std::min(o.formats.find(',', at), o.formats.size());
    const std::string name = o.formats.substr(at, comma - at);
    const std::optional<QuantMethod> m = ParseQuantMethod(name);
    if (!m || !(*m == QuantMethod::kFp8 || *m == QuantMethod::kNf4))
      throw Error(ErrorCode::kInvalidArgument,
                  "--formats: `" + name + "` is not fp8 or nf4 (a comma-separated list)");
    methods.push_back(*m);
    at = comma + 1;
  }
  const Device typed_device = ParseDevice(o.device);
  const c10::Device device = TorchDevice(typed_device);
  const c10::ScalarType dtype =
      ScalarTypeOf(ComputeDType(job.train.dtype, typed_device), "the compute dtype");

  const auto plain_store = Pack(o, job, QuantMethod::kNone);
  const std::string plain_name = plain_store->manifest().store_name;
  const BaseWeights plain = BaseWeights::FromStore(plain_name);
  const JobData data = LoadJobData(job, plain.config().vocab_size);
  std::vector<Batch> batches;
  const int64_t rows = job.train.batch_size;
  for (int64_t first = 0;
       first < data.eval.count && static_cast<int>(batches.size()) < o.kl_batches; first += rows) {
    std::vector<int64_t> indices;
    for (int64_t k = first; k < std::min(data.eval.count, first + rows); ++k) indices.push_back(k);
    batches.push_back(MakeBatchOf(data.eval, indices));
  }
  const BaseOutputs reference = RunBase(plain, batches, device, dtype);
  nlohmann::json report = {
      {"job", o.job_path},
      {"device", o.device},
      {"dtype", ShortDTypeName(DTypeOf(dtype))},
      {"steps", data.steps},
      {"kl_tokens", static_cast<int64_t>(batches.size()) * rows * job.data.seq_len},
      {"bf16",
       {{"block_bytes", BlockBytes(plain_store->manifest())},
        {"base_eval_loss", reference.loss},
        {"trained_eval_loss", TrainedEvalLoss(job, o, plain_name, "bf16")}}}};
  for (QuantMethod method : methods) {
    const std::string tag = QuantMethodName(method);
    const auto store = Pack(o, job, method);
    const BaseWeights q = BaseWeights::FromStore(store->manifest().store_name);
    const BaseOutputs outputs = RunBase(q, batches, device, dtype);
    const auto [kl_mean, kl_max] = KlDivergence(reference, outputs);
    report[tag] = {
        {"format", DescribeQuant(store->manifest().quant())},
        {"block_bytes", BlockBytes(store->manifest())},
        {"sqnr_db", WeightSqnr(plain, q, device)},
        {"expand_ms_per_block",
         1e3 * MeasureBlockExpansion(q.block_bytes()[0], q.manifest()->blocks[0], device, dtype)},
        {"kl_mean", kl_mean},
        {"kl_max", kl_max},
        {"base_eval_loss", outputs.loss},
        {"trained_eval_loss", TrainedEvalLoss(job, o, store->manifest().store_name, tag)}};
  }

  // The table.
  const nlohmann::json& b = report["bf16"];
  std::printf("quant-report: %s, %lld steps, KL over %lld tokens, %s on %s\n", o.job_path.c_str(),
              static_cast<long long>(data.steps), report["kl_tokens"].get<long long>(),
              report["dtype"].get<std::string>().c_str(), o.device.c_str());
  std::printf("%-6s %10s", "base", "blocks");
  for (const char* k : kKinds) std::printf(" %9s", k);
  std::printf(" %9s %10s %10s %10s %12s %10s\n", "all dB", "KL mean", "KL max", "base eval",
              "trained eval", "expand ms");
  std::printf("%-6s %10s", "bf16", FormatBytes(b["block_bytes"].get<uint64_t>()).c_str());
  for (int k = 0; k < 8; ++k) std::printf(" %9s", "-");
  std::printf(" %10s %10s %10.5f %12.5f %10s\n", "-", "-", b["base_eval_loss"].get<double>(),
              b["trained_eval_loss"].get<double>(), "-");
  for (QuantMethod method : methods) {
    const nlohmann::json& r = report[QuantMethodName(method)];
    std::printf("%-6s %10s", QuantMethodName(method),
                FormatBytes(r["block_bytes"].get<uint64_t>()).c_str());
    for (const char* k : kKinds) std::printf(" %9.2f", r["sqnr_db"].value(k, std::nan("")));
    std::printf(" %9.2f %10.3e %10.3e %10.5f %12.5f %10.3f\n", r["sqnr_db"]["all"].get<double>(),
                r["kl_mean"].get<double>(), r["kl_max"].get<double>(),
                r["base_eval_loss"].get<double>(), r["trained_eval_loss"].get<double>(),
                r["expand_ms_per_block"].get<double>());
  }
  std::printf(
      "legend: blocks = one transformer block's bytes in the store; q_proj..down_proj and all "
      "dB = the\n"
      "  weights' signal-to-quantisation-noise ratio (higher is closer to bf16; about 6 dB per "
      "bit)\n"
      "  KL mean / max = the base model's next-token distributions against bf16's on the eval "
      "tokens (nats; 0 = same)\n"
      "  base eval / trained eval = eval loss before and after the job's training on that base; "
      "expand ms = one block's\n"
      "  expansion to bf16 on the device. A trained eval loss close to bf16's says the format "
      "serves this job;\n"
      "  fp8 keeps more of the weights, NF4 halves fp8's bytes again.\n");
  std::fflush(stdout);
  if (!o.out_path.empty()) {
    std::ofstream f(o.out_path);
    f << report.dump(2) << "\n";
    if (!f) throw Error(ErrorCode::kIo, o.out_path + ": write failed");
  }
  return 0;
}

}  // namespace lorastream::worker
