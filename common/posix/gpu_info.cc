#include "common/posix/gpu_info.h"

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "common/base/error.h"
#include "common/posix/subprocess.h"

namespace lorastream {

namespace fs = std::filesystem;

namespace {

std::string Trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t\r\n") - b + 1);
}

std::vector<std::string> SplitCsv(const std::string& line) {
  std::vector<std::string> fields;
  std::istringstream in(line);
  for (std::string f; std::getline(in, f, ',');) fields.push_back(Trim(f));
  return fields;
}

uint64_t MiB(const std::string& text) {
  try {
    return static_cast<uint64_t>(std::stod(text) * 1024 * 1024);
  } catch (const std::exception&) {
    return 0;  // "[N/A]" and the like
  }
}

// nvidia-smi's CSV query; false when it is missing or fails (older drivers lack compute_cap:
// asked again without it).
bool FromNvidiaSmi(std::vector<GpuInfo>* gpus) {
  for (const bool with_cc : {true, false}) {
    std::string fields = "index,name,memory.total,memory.used";
    if (with_cc) fields += ",compute_cap";
    int code = 0;
    std::string out;
    try {
      out = RunAndCapture({"nvidia-smi", "--query-gpu=" + fields, "--format=csv,noheader,nounits"},
                          &code, 20, "/dev/null");
    } catch (const Error&) {
      return false;  // no nvidia-smi
    }
    if (code != 0) continue;
    std::istringstream lines(out);
    for (std::string line; std::getline(lines, line);) {
      std::vector<std::string> f = SplitCsv(line);
      if (f.size() < 4) continue;
      GpuInfo g;
      try {
        g.index = std::stoi(f[0]);
      } catch (const std::exception&) {
        continue;
      }
      g.name = f[1];
      g.memory_total = MiB(f[2]);
      g.memory_used = MiB(f[3]);
      if (with_cc && f.size() > 4) g.compute_capability = f[4];
      gpus->push_back(g);
    }
    return true;
  }
  return false;
}

// One folder per GPU (named by its PCI address), each with an `information` file.
std::vector<GpuInfo> FromDriverFolder(const std::string& dir) {
  std::vector<std::string> entries;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) entries.push_back(e.path().string());
  std::sort(entries.begin(), entries.end());
  std::vector<GpuInfo> gpus;
  for (const std::string& entry : entries) {
    GpuInfo g;
    g.index = static_cast<int>(gpus.size());
    std::ifstream info(entry + "/information");
    for (std::string line; std::getline(info, line);)
      if (line.rfind("Model:", 0) == 0) g.name = Trim(line.substr(6));
    gpus.push_back(g);
  }
  return gpus;
}

}  // namespace

std::vector<GpuInfo> ListGpus() {
  if (const char* dir = std::getenv("LORASTREAM_NVIDIA_GPUS_DIR"); dir && *dir)
    return FromDriverFolder(dir);
  std::vector<GpuInfo> gpus;
  if (FromNvidiaSmi(&gpus)) return gpus;
  return FromDriverFolder("/proc/driver/nvidia/gpus");
}

std::vector<std::string> VisibleCudaDevices() {
  size_t count = ListGpus().size();
  // CUDA_VISIBLE_DEVICES renumbers the visible GPUs from 0.
  if (const char* visible = std::getenv("CUDA_VISIBLE_DEVICES")) {
    const std::string v = visible;
    size_t n = v.empty() ? 0 : 1;
    for (char c : v) n += c == ',';
    if (v == "-1" || v == "none") n = 0;
    count = std::min(count, n);
  }
  std::vector<std::string> devices;
  for (size_t i = 0; i < count; ++i) devices.push_back("cuda:" + std::to_string(i));
  return devices;
}

}  // namespace lorastream
