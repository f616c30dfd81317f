#include "worker/flux/flux_train.h"

#include <sys/stat.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <thread>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "common/acting_as.h"
#include "common/error.h"
#include "common/format_bytes.h"
#include "common/job_access.h"
#include "common/log.h"
#include "worker/flux/flux_adapter_io.h"
#include "worker/flux/flux_base.h"
#include "worker/flux/flux_calibrate.h"
#include "worker/flux/flux_checkpoint.h"
#include "worker/flux/flux_data.h"
#include "worker/flux/flux_model.h"
#include "worker/flux/flux_objective.h"
#include "worker/model/base_weights.h"
#include "worker/model/model.h"
#include "worker/model/torch_device.h"
#include "worker/train/adamw.h"

namespace lorastream::worker::flux {

FluxTrainResult TrainFlux(const FluxJob& job_spec, const FluxTrainOptions& options) {
  at::set_num_threads(options.threads > 0 ? options.threads
                                          : static_cast<int>(std::thread::hardware_concurrency()));
  const c10::Device device = TorchDevice(ParseDevice(options.device));
  const c10::ScalarType dtype = job_spec.dtype == "bf16" ? at::kBFloat16 : at::kFloat;
  const FluxBase base = [&] {
    // A checkpoint is read as the job's submitter; a store is this worker's to attach.
    const ActingAs as(job_spec.store.empty() ? options.files_as : nullptr);
    return FluxBase::ForJob(job_spec, dtype, device);
  }();
  const ActingAs as_submitter(options.files_as);
  FluxJob job = job_spec;
  job.singles_per_unit = base.singles_per_unit();  // a store's units are the store's
  OutputDirLock lock = OutputDirLock::CreateAndAcquire(job.output_dir, options.lock_holder);
  const FluxConfig& config = base.config();
  const FluxDataset data(job.cache_dir, config);
  const FluxPlanning planning = PlanFluxJob(base, job, data, device, dtype);
  auto engine = base.MakeEngine(planning.plan, device, options.engine);
  FluxModel model(config, base.rest(), engine.get(), job.singles_per_unit, device, dtype);
  FluxAdapter adapter(config, FluxTargets(job.targets, "flux.targets"), job.rank, job.alpha,
                      MixSeed(job.seed, 0xada7), device);
  AdamWOptions adam;
  adam.weight_decay = job.weight_decay;
  AdamW optimizer(adapter.Params(), adam);
  TimestepSampling sampling{job.timestep_sampling, job.sigmoid_scale, job.discrete_flow_shift};
  FluxTrainResult result;
  TrainerStateMeta state;
  state.seed = job.seed;
  state.fingerprint = FluxJobFingerprint(job);
  if (options.resume) {
    const std::string from = FindFluxCheckpoint(job.output_dir);
    if (!from.empty()) {
      state = LoadFluxCheckpoint(from, state.fingerprint, adapter, optimizer);
      LS_LOG_INFO("resuming from {} (step {} of {})", from, state.step, job.steps);
      result.checkpoint_dir = from;
    }
  }
  LS_LOG_INFO(
      "FLUX job: {} images in {} buckets, {} adapted modules (rank {}, alpha {}), {} of {} "
      "units streamed",
      data.size(), data.buckets(), adapter.modules().size(), job.rank, job.alpha,
      planning.plan.num_streamed(), model.units().size());

  result.first_step = state.step;
  for (int64_t step = state.step; step < job.steps; ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    const FluxDataBatch b = data.Batch(step, job.batch_size, job.seed);
    const int64_t n = b.latents.size(0), h = b.latents.size(2), w = b.latents.size(3);
    at::Generator gen = at::detail::createCPUGenerator(MixSeed(job.seed, 0x5eed, step));
    const at::Tensor noise = at::empty(b.latents.sizes(), at::kFloat).normal_(0.0, 1.0, gen);
    const at::Tensor t = SampleTimesteps(sampling, n, h, w, gen);
    const FlowMatch fm = MakeFlowMatch(b.latents, noise, t);

    FluxBatch batch;
    batch.img = PackLatents(fm.noisy).to(device, dtype);
    batch.img_ids = ImageIds(n, h, w, device);
    batch.txt = b.t5.to(device, dtype);
    batch.txt_ids = b.txt_ids.to(device);
    batch.y = b.pooled.to(device, dtype);
    batch.timesteps = t.to(device);
    batch.guidance = at::full({n}, job.guidance, at::TensorOptions(device).dtype(at::kFloat));

    engine->BeginStep();
    const at::Tensor pred = model.Forward(batch, adapter, /*checkpointed=*/true);
    const at::Tensor loss = FlowLoss(pred, PackLatents(fm.target).to(device));
    loss.backward();
    StepStats stats;
    engine->EndStep(stats);
    const at::Tensor norm = ClipGradNormAsync(adapter.Params(), job.max_grad_norm);
    const double lr =
        job.learning_rate * ScheduleFactor(job.lr_schedule, step, job.warmup_steps, job.steps);
    optimizer.Step(lr);
    optimizer.ZeroGrad();

    stats.step = step + 1;
    stats.total_steps = job.steps;
    stats.loss = loss.item<double>();
    stats.learning_rate = lr;
    stats.grad_norm = norm.defined() ? norm.item<double>() : 0.0;
    stats.tokens = n * (h / 2) * (w / 2);
    stats.step_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    stats.tokens_per_second = static_cast<double>(stats.tokens) / stats.step_seconds;
    if (!std::isfinite(stats.loss))
      throw Error(ErrorCode::kRefused, "FLUX step " + std::to_string(step + 1) +
                                           ": the loss is not finite (lower flux.learning_rate)");
    LS_LOG_INFO(
        "step {}/{} loss {:.6f} lr {:.3g} grad_norm {:.4f} {}x{} x{} {:.3f} s, H2D {} in {} "
        "copies ({} saved), peak {:.3f} GiB",
        stats.step, job.steps, stats.loss, lr, stats.grad_norm, w * 8, h * 8, n, stats.step_seconds,
        FormatBytes(stats.h2d_bytes), stats.copies, stats.copies_saved,
        stats.peak_device_bytes / double(uint64_t{1} << 30));
    result.steps.push_back(stats);
    if (options.on_step) options.on_step(stats);
    lock.RequireOwned();  // a later attempt of the job took the folder: nothing more is written
    const bool stop = options.stop != nullptr && options.stop->load() != 0;
    const bool last = step + 1 == job.steps;
    state.step = step + 1;
    state.samples_seen += n;
    // The final adapters before the last checkpoint: a job killed between the two resumes
    // from an earlier checkpoint and writes them again, so a checkpoint at the last step (after
    // which a resume trains nothing) always has its adapters beside it.
    if (last) {
      SaveFluxAdapters(adapter, config, job.output_dir);
      result.kohya_path = job.output_dir + "/" + kKohyaAdapterFile;
      result.diffusers_path = job.output_dir + "/" + kDiffusersAdapterFile;
    }
    if ((job.save_every > 0 && state.step % job.save_every == 0) || last || stop)
      result.checkpoint_dir = SaveFluxCheckpoint(job.output_dir, adapter, config, optimizer, state,
                                                 job.keep_checkpoints);
    if (stop) break;
  }
  return result;
}

int RunFluxTrainCommand(const std::string& job_path, const FluxTrainOptions& options) {
  const FluxJob job = LoadFluxJob(job_path);
  const FluxTrainResult r = TrainFlux(job, options);
  const int64_t done = r.first_step + static_cast<int64_t>(r.steps.size());
  if (r.steps.empty()) {
    std::printf(
        "already complete: %s is at step %lld, at or past the job's last step (flux.steps = "
        "%lld); nothing trained, adapters in %s\n",
        r.checkpoint_dir.c_str(), static_cast<long long>(r.first_step),
        static_cast<long long>(job.steps), job.output_dir.c_str());
    return 0;
  }
  if (done < job.steps) {
    const int signal = options.stop != nullptr ? options.stop->load() : 0;
    std::printf(
        "stopped by signal %d at step %lld: checkpoint in %s (run the same command to "
        "resume)\n",
        signal, static_cast<long long>(done), r.checkpoint_dir.c_str());
    return 128 + signal;
  }
  std::printf(
      "done: steps %lld..%lld, final loss %.6f\nadapter (kohya, ComfyUI/Forge): %s\n"
      "adapter (diffusers load_lora_weights): %s\n",
      static_cast<long long>(r.first_step + 1), static_cast<long long>(done), r.steps.back().loss,
      r.kohya_path.c_str(), r.diffusers_path.c_str());
  return 0;
}

}  // namespace lorastream::worker::flux
