// The registry of model families: one row per family (its name, which jobs it trains, its
// group, its plan command). A new family is a folder of its own and one row here.
#include "worker/families.h"

#include <functional>
#include <memory>

#include "common/base/error.h"
#include "common/formats/toml_file.h"
#include "common/job/job_spec.h"
#include "common/posix/regular_file.h"
#include "worker/flux/flux_calibrate.h"
#include "worker/flux/flux_family.h"
#include "worker/flux/flux_group.h"
#include "worker/llm/llm_family.h"
#include "worker/qwen_image/qwen_image_family.h"
#include "worker/train/family.h"

namespace lorastream::worker {

namespace {

struct FamilyRow {
  const char* name;
  bool (*accepts)(const JobSpec&);
  std::unique_ptr<FamilyGroup> (*make_group)(const JobSpec&, const TrainOptions&,
                                             std::function<bool()>);
  int (*plan)(const std::vector<std::string>& job_paths, const PlanCommandOptions& options);
};

int PlanFlux(const std::vector<std::string>& paths, const PlanCommandOptions& options) {
  return paths.size() == 1 ? flux::RunFluxPlanCommand(paths[0], options.device)
                           : flux::RunFluxGroupPlanCommand(paths, options.device);
}

int PlanLlm(const std::vector<std::string>& paths, const PlanCommandOptions& options) {
  return RunPlanCommand(paths, options);
}

const std::vector<FamilyRow>& Families() {
  static const std::vector<FamilyRow> rows = {
      {"FLUX", flux::Accepts, flux::MakeGroup, PlanFlux},
      {"LLM", llm::Accepts, llm::MakeGroup, PlanLlm},
      {"Qwen-Image", qwen_image::Accepts, qwen_image::MakeGroup, qwen_image::RunPlan},
  };
  return rows;
}

const FamilyRow& RowOf(const JobSpec& spec) {
  for (const FamilyRow& row : Families())
    if (row.accepts(spec)) return row;
  throw Error(ErrorCode::kUnsupported, "job " + spec.name + ": no model family trains it");
}

// The family a job file's sections name; "" when it cannot be read (its loader names why).
std::string FamilyOfFile(const std::string& path) {
  try {
    return FamilyName(ParseJobSpec(ReadRegularFile(path, kMaxTomlBytes, "job file"), path));
  } catch (const Error&) {
    return "";
  }
}

}  // namespace

std::string FamilyName(const JobSpec& spec) { return RowOf(spec).name; }

std::unique_ptr<FamilyGroup> MakeFamilyGroup(const JobSpec& first, const TrainOptions& options,
                                             std::function<bool()> all_stop) {
  return RowOf(first).make_group(first, options, std::move(all_stop));
}

void RequireOneFamily(const std::vector<std::string>& job_paths) {
  if (job_paths.size() < 2) return;
  const std::string first = FamilyOfFile(job_paths[0]);
  for (size_t i = 1; i < job_paths.size(); ++i) {
    const std::string name = FamilyOfFile(job_paths[i]);
    if (!first.empty() && !name.empty() && name != first)
      throw Error(ErrorCode::kInvalidArgument,
                  job_paths[i] + " is not a " + first + " job but " + job_paths[0] +
                      " is: a group trains one family on one base (FLUX.1 jobs share a group "
                      "only with FLUX.1 jobs, Qwen-Image jobs with Qwen-Image jobs, LLM jobs "
                      "with LLM jobs)");
  }
}

int RunFamilyPlanCommand(const std::vector<std::string>& job_paths,
                         const PlanCommandOptions& options) {
  LS_CHECK(!job_paths.empty(), "plan needs a job file");
  RequireOneFamily(job_paths);
  return RowOf(LoadJobSpec(job_paths[0])).plan(job_paths, options);
}

}  // namespace lorastream::worker
