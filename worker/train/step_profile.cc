#include "worker/train/step_profile.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <set>
#include <utility>
#include <vector>

#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/version.h>
#include <nlohmann/json.hpp>

#include "common/base/error.h"
#include "common/base/log.h"

namespace lorastream::worker {
namespace {

namespace kp = torch::autograd::profiler;
namespace kimpl = torch::profiler::impl;

int64_t DurationNs(const kp::KinetoEvent& e) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1)
  return static_cast<int64_t>(e.durationNs());
#else
  return static_cast<int64_t>(e.durationUs()) * 1000;
#endif
}

int64_t StartNs(const kp::KinetoEvent& e) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1)
  return static_cast<int64_t>(e.startNs());
#else
  return static_cast<int64_t>(e.startUs()) * 1000;
#endif
}

// A kernel's kind, from its name (cuBLAS/CUTLASS GEMMs, attention, copies, ...): the first
// question of a profile is which kind of work the time went to.
std::string KindOf(const std::string& name) {
  auto has = [&](const char* s) { return name.find(s) != std::string::npos; };
  if (has("Memcpy") || has("memcpy")) return "copy";
  if (has("Memset") || has("memset")) return "memset";
  if (has("flash") || has("fmha") || has("attention") || has("Attention") || has("sdpa"))
    return "attention";
  if (has("gemm") || has("Gemm") || has("GEMM") || has("cutlass") || has("nvjet") || has("xmma") ||
      has("cublas") || has("grouped_mm") || has("GroupedMm") || has("wgmma") || has("aten::mm") ||
      has("aten::addmm") || has("aten::bmm"))
    return "GEMM";
  if (has("reduce") || has("Reduce") || has("softmax") || has("norm") || has("Norm"))
    return "reduction / norm";
  if (has("sort") || has("Sort") || has("scan") || has("Scan") || has("index") || has("Index") ||
      has("scatter") || has("gather") || has("cat") || has("Cat"))
    return "index / sort / cat";
  if (has("elementwise") || has("vectorized") || has("unrolled") || has("aten::"))
    return "elementwise / other op";
  return "other";
}

std::string Ms(int64_t ns) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3f", static_cast<double>(ns) / 1e6);
  return buf;
}

std::string Percent(int64_t part, int64_t whole) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f%%",
                whole > 0 ? 100.0 * static_cast<double>(part) / static_cast<double>(whole) : 0.0);
  return buf;
}

std::string Cell(std::string s) {
  for (char& c : s)
    if (c == '|' || c == '\n') c = ' ';
  if (s.size() > 110) s = s.substr(0, 107) + "...";
  return s;
}

struct Tally {
  int64_t calls = 0;
  int64_t ns = 0;
};

// The device's busy time: the union of the events' intervals (streams overlap).
int64_t BusyNs(std::vector<std::pair<int64_t, int64_t>> spans) {
  std::sort(spans.begin(), spans.end());
  int64_t busy = 0, end = INT64_MIN;
  for (const auto& [s, e] : spans) {
    if (s >= end) {
      busy += e - s;
      end = e;
    } else if (e > end) {
      busy += e - end;
      end = e;
    }
  }
  return busy;
}

}  // namespace

void CheckStepProfile(const StepProfileOptions& options) {
  if (options.path.empty()) return;
  if (options.first < 1)
    throw Error(ErrorCode::kInvalidArgument,
                "--profile-from must be 1 or more (the first profiled step, counting from 1), "
                "got " +
                    std::to_string(options.first));
  if (options.steps < 1)
    throw Error(ErrorCode::kInvalidArgument,
                "--profile-steps must be 1 or more, got " + std::to_string(options.steps));
  for (const std::string& path : {options.path, options.path + ".md"}) {
    std::ofstream probe(path, std::ios::trunc);
    if (!probe)
      throw Error(ErrorCode::kInvalidArgument,
                  "--profile: cannot write " + path + " (does its folder exist?)");
  }
}

StepProfile::StepProfile(StepProfileOptions options, const std::string& device)
    : options_(std::move(options)), cuda_(device.rfind("cuda", 0) == 0) {
  CheckStepProfile(options_);
}

StepProfile::~StepProfile() {
  if (!recording_) return;
  try {
    Finish();
  } catch (const std::exception& e) {
    LS_LOG_WARN("the profile could not be written: {}", e.what());
  }
}

void StepProfile::BeforeStep() {
  ++step_;
  if (step_ != options_.first) return;
  const kimpl::ProfilerConfig config(kimpl::ProfilerState::KINETO);
  std::set<kimpl::ActivityType> activities{kimpl::ActivityType::CPU};
  if (cuda_) activities.insert(kimpl::ActivityType::CUDA);
  kp::prepareProfiler(config, activities);
  kp::enableProfiler(config, activities);
  recording_ = true;
  window_start_ = std::chrono::steady_clock::now();
  LS_LOG_INFO("profiling steps {} to {} of this run into {}", options_.first,
              options_.first + options_.steps - 1, options_.path);
}

void StepProfile::AfterStep() {
  if (recording_ && step_ == options_.first + options_.steps - 1) Finish();
}

void StepProfile::Finish() {
  const int64_t wall_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                              std::chrono::steady_clock::now() - window_start_)
                              .count();
  const int64_t steps = std::max<int64_t>(1, step_ - options_.first + 1);
  recording_ = false;
  std::unique_ptr<kp::ProfilerResult> result = kp::disableProfiler();
  if (!result) throw Error(ErrorCode::kInternal, "the profiler returned no result");
  // The Chrome trace, written from the events (LibTorch's own writer needs a Kineto build,
  // which Debian's is not): host operators on the threads that ran them, device events on
  // their streams, times in microseconds from the window's first event.
  const auto& events = result->events();
  int64_t origin = INT64_MAX;
  for (const kp::KinetoEvent& e : events) origin = std::min(origin, StartNs(e));
  {
    std::ofstream trace(options_.path, std::ios::trunc);
    trace << "{\"traceEvents\": [";
    bool first_event = true;
    for (const kp::KinetoEvent& e : events) {
      const bool device_event = e.deviceType() != c10::DeviceType::CPU;
      nlohmann::json j = {
          {"name", e.name()},
          {"ph", "X"},
          {"ts", static_cast<double>(StartNs(e) - origin) / 1e3},
          {"dur", static_cast<double>(DurationNs(e)) / 1e3},
          {"pid", device_event ? "device" : "host"},
          {"tid", device_event ? e.deviceResourceId() : static_cast<int64_t>(e.startThreadId())},
          {"cat", device_event ? "device" : "host"}};
      trace << (first_event ? "\n" : ",\n")
            << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
      first_event = false;
    }
    trace << "\n]}\n";
    if (!trace) throw Error(ErrorCode::kIo, "could not write " + options_.path);
  }

  // On CUDA the device's events (kernels, copies, memsets: exclusive times); on the CPU the
  // ATen operators (inclusive: an aten::linear holds its aten::addmm).
  std::map<std::string, Tally> by_name, by_kind;
  std::vector<std::pair<int64_t, int64_t>> spans;
  int64_t total = 0;
  for (const kp::KinetoEvent& e : events) {
    const bool device_event = e.deviceType() != c10::DeviceType::CPU;
    const std::string name = e.name();
    if (cuda_ ? !device_event : name.rfind("aten::", 0) != 0) continue;
    const int64_t ns = DurationNs(e);
    Tally& t = by_name[name];
    ++t.calls;
    t.ns += ns;
    if (cuda_) {
      Tally& k = by_kind[KindOf(name)];
      ++k.calls;
      k.ns += ns;
      spans.emplace_back(StartNs(e), StartNs(e) + ns);
      total += ns;
    }
  }
  std::vector<std::pair<std::string, Tally>> rows(by_name.begin(), by_name.end());
  std::sort(rows.begin(), rows.end(),
            [](const auto& a, const auto& b) { return a.second.ns > b.second.ns; });

  std::ofstream md(options_.path + ".md", std::ios::trunc);
  md << "# Profile of steps " << options_.first << " to " << step_ << "\n\n";
  md << "- wall time of the window: " << Ms(wall_ns) << " ms (" << Ms(wall_ns / steps)
     << " ms a step)\n";
  if (cuda_) {
    const int64_t busy = BusyNs(spans);
    md << "- the device was busy " << Ms(busy) << " ms (" << Percent(busy, wall_ns)
       << " of the wall time); its events add up to " << Ms(total)
       << " ms (more than busy where streams overlap)\n\n";
    std::vector<std::pair<std::string, Tally>> kinds(by_kind.begin(), by_kind.end());
    std::sort(kinds.begin(), kinds.end(),
              [](const auto& a, const auto& b) { return a.second.ns > b.second.ns; });
    md << "| kind | calls | ms a step | share |\n| --- | --- | --- | --- |\n";
    for (const auto& [kind, t] : kinds)
      md << "| " << kind << " | " << t.calls / steps << " | " << Ms(t.ns / steps) << " | "
         << Percent(t.ns, total) << " |\n";
    md << "\n| kernel | kind | calls a step | ms a step | share |\n| --- | --- | --- | --- | --- "
          "|\n";
  } else {
    md << "- times are inclusive (an operator holds those it calls)\n\n";
    md << "| operator | calls a step | ms a step | share of the wall |\n| --- | --- | --- | --- "
          "|\n";
  }
  size_t shown = 0;
  for (const auto& [name, t] : rows) {
    if (++shown > 60) break;
    md << "| " << Cell(name) << " | ";
    if (cuda_) md << KindOf(name) << " | ";
    md << static_cast<double>(t.calls) / static_cast<double>(steps) << " | " << Ms(t.ns / steps)
       << " | " << Percent(t.ns, cuda_ ? total : wall_ns) << " |\n";
  }
  if (!md) throw Error(ErrorCode::kIo, "could not write " + options_.path + ".md");
  written_ = true;
  LS_LOG_INFO("profile written: {} (Chrome trace) and {}.md (the kernels)", options_.path,
              options_.path);
}

}  // namespace lorastream::worker
