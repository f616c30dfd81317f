#include "common/job/qwen_image_job.h"

#include <cmath>

#include "common/formats/toml_file.h"

namespace lorastream {

QwenImageJob ParseQwenImageSection(const TomlSection& s) {
  s.RejectUnknownKeys(
      {"cache_dir", "timestep_sampling", "sigmoid_scale", "discrete_flow_shift", "edit"});
  QwenImageJob j;
  j.cache_dir = s.GetString("cache_dir", "");
  j.timestep_sampling = s.GetString("timestep_sampling", j.timestep_sampling);
  j.sigmoid_scale = s.GetDouble("sigmoid_scale", j.sigmoid_scale);
  j.discrete_flow_shift = s.GetDouble("discrete_flow_shift", j.discrete_flow_shift);
  j.edit = s.GetBool("edit", j.edit);
  return j;
}

std::vector<std::string> QwenImageJobProblems(const QwenImageJob& j, const std::string& source) {
  std::vector<std::string> p;
  auto key = [&](const std::string& k) { return source + ": key `qwen_image." + k + "` "; };
  if (j.cache_dir.empty())
    p.push_back(key("cache_dir") + "is required (a folder of musubi-tuner's Qwen-Image caches)");
  const std::string& m = j.timestep_sampling;
  if (m != "uniform" && m != "sigmoid" && m != "shift" && m != "qwen_shift")
    p.push_back(key("timestep_sampling") +
                "must be uniform, sigmoid, shift or qwen_shift (found `" + m + "`)");
  if (!(j.sigmoid_scale > 0) || !std::isfinite(j.sigmoid_scale))
    p.push_back(key("sigmoid_scale") + "must be a positive number");
  if (!(j.discrete_flow_shift > 0) || !std::isfinite(j.discrete_flow_shift))
    p.push_back(key("discrete_flow_shift") + "must be a positive number");
  return p;
}

}  // namespace lorastream
