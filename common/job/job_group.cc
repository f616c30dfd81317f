#include "common/job/job_group.h"

#include <algorithm>
#include <utility>

#include "common/job/flux_job.h"

namespace lorastream {

namespace {

// Two FLUX.1 jobs: one base (one store, or one checkpoint packed alike), one compute dtype,
// one plan. Everything else (caches, resolution, batch, rank, targets, steps) is the job's own.
// Keys are named as the refused job's file writes them (FluxKeyName).
std::string FluxGroupRefusal(const std::string& why, const FluxJob& first, const FluxJob& job) {
  const auto key = [&job](const char* flux_key) { return FluxKeyName(job, flux_key); };
  if (job.store != first.store)
    return why + key("store") + " differs (`" + job.store + "`, `" + first.store +
           "`): a group shares one base";
  if (job.checkpoint != first.checkpoint)
    return why + key("checkpoint") + " differs (`" + job.checkpoint + "`, `" + first.checkpoint +
           "`): a group shares one base";
  if (job.dtype != first.dtype)
    return why + key("dtype") + " differs (" + job.dtype + ", " + first.dtype +
           "): a group computes in one dtype";
  const std::pair<const char*, bool> fields[] = {
      {"singles_per_unit", job.singles_per_unit != first.singles_per_unit},
      {"gpu_memory_budget",
       job.gpu_memory_budget != first.gpu_memory_budget || job.budget_auto != first.budget_auto},
      {"blocks_to_swap", job.blocks_to_swap != first.blocks_to_swap},
      {"ring_size", job.ring_size != first.ring_size},
      {"taped_blocks", job.taped_blocks != first.taped_blocks}};
  for (const auto& [field, differs] : fields)
    if (differs) return why + key(field) + " differs: a group streams one packing and one plan";
  return "";
}

}  // namespace

std::string GroupRefusal(const JobSpec& first, const JobSpec& job, const std::string& device) {
  const std::string why =
      "job " + job.name + " cannot train in a group with job " + first.name + ": ";
  if (job.is_flux != first.is_flux)
    return why + "job " + (job.is_flux ? job.name : first.name) +
           " is a FLUX.1 job: FLUX.1 jobs share a group only with FLUX.1 jobs on their base";
  if (job.is_flux) return FluxGroupRefusal(why, first.flux, job.flux);
  if (job.is_qwen_image != first.is_qwen_image)
    return why + "job " + (job.is_qwen_image ? job.name : first.name) +
           " is a Qwen-Image job: Qwen-Image jobs share a group only with Qwen-Image jobs on "
           "their base";
  if (job.model.store != first.model.store)
    return why + "model.store differs (`" + job.model.store + "`, `" + first.model.store +
           "`): a group shares one base";
  if (job.model.checkpoint != first.model.checkpoint)
    return why + "model.checkpoint differs (`" + job.model.checkpoint + "`, `" +
           first.model.checkpoint + "`): a group shares one base";
  auto dtype = [&](const JobSpec& s) {
    if (s.train.dtype != "auto") return s.train.dtype;
    return std::string(device.rfind("cuda", 0) == 0 ? "bf16" : "f32");
  };
  if (dtype(job) != dtype(first))
    return why + "train.dtype differs (" + dtype(job) + ", " + dtype(first) +
           "): a group computes in one dtype";
  const StreamSpec &a = job.stream, &b = first.stream;
  const std::pair<const char*, bool> fields[] = {
      {"stream.blocks_to_swap", a.blocks_to_swap != b.blocks_to_swap},
      {"stream.gpu_memory_budget",
       a.gpu_memory_budget != b.gpu_memory_budget || a.budget_auto != b.budget_auto},
      {"stream.ring_size", a.ring_size != b.ring_size},
      {"stream.forward_slots", a.forward_slots != b.forward_slots},
      {"stream.backward_slots", a.backward_slots != b.backward_slots},
      {"stream.taped_blocks", a.taped_blocks != b.taped_blocks}};
  for (const auto& [field, differs] : fields)
    if (differs) return why + field + " differs: a group streams one plan";
  return "";
}

int DefaultJobSlots(uint64_t gpu_memory_bytes) {
  if (gpu_memory_bytes == 0) return 1;
  return static_cast<int>(std::clamp<uint64_t>(gpu_memory_bytes / (kGiBPerJobSlot << 30), 1,
                                               static_cast<uint64_t>(kMaxDefaultJobSlots)));
}

}  // namespace lorastream
