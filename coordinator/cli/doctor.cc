#include "coordinator/cli/doctor.h"

#include <sys/resource.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "common/base/error.h"
#include "common/posix/gpu_info.h"
#include "common/posix/install_paths.h"
#include "common/posix/subprocess.h"
#include "coordinator/client/build_info.h"
#include "coordinator/client/client.h"
#include "coordinator/client/curve.h"
#include "store/registry.h"

namespace lorastream::cli {

namespace {

constexpr uint64_t kGiB = 1ull << 30;
const char* const kShmemHugeFile = "/sys/kernel/mm/transparent_hugepage/shmem_enabled";

void AddProblem(nlohmann::json& report, const std::string& check, const std::string& problem,
                const std::string& fix) {
  report["problems"].push_back({{"check", check}, {"problem", problem}, {"fix", fix}});
}

std::string Bytes(uint64_t n) {
  char buf[32];
  if (n >= kGiB)
    std::snprintf(buf, sizeof buf, "%.1f GiB", n / double(kGiB));
  else
    std::snprintf(buf, sizeof buf, "%.1f MiB", n / double(1 << 20));
  return buf;
}

nlohmann::json BuildCheck(nlohmann::json& report, size_t gpus) {
  const client::BuildInfo& b = client::ThisBuild();
  nlohmann::json j{{"cuda", b.cuda},
                   {"libtorch_version", b.libtorch_version},
                   {"libtorch_dir", b.libtorch_dir},
                   {"cuda_version", b.cuda_version},
                   {"summary", client::BuildSummary(b)}};
  if (!b.cuda && gpus > 0)
    AddProblem(
        report, "build",
        "this build is CPU-only on a machine with " + std::to_string(gpus) + " NVIDIA GPU(s)",
        "rebuild with `tools/setup.sh` (it picks python3's CUDA torch, or set "
        "LORASTREAM_LIBTORCH=DIR)");
  return j;
}

nlohmann::json GpuCheck(const std::vector<GpuInfo>& gpus) {
  nlohmann::json list = nlohmann::json::array();
  for (const GpuInfo& g : gpus)
    list.push_back({{"index", g.index},
                    {"name", g.name},
                    {"memory_total_bytes", g.memory_total},
                    {"memory_used_bytes", g.memory_used},
                    {"compute_capability", g.compute_capability}});
  return list;
}

nlohmann::json MemlockCheck(nlohmann::json& report) {
  rlimit limit{};
  getrlimit(RLIMIT_MEMLOCK, &limit);
  const bool unlimited = limit.rlim_cur == RLIM_INFINITY;
  nlohmann::json j{{"unlimited", unlimited}, {"root", geteuid() == 0}};
  j["soft_bytes"] = unlimited ? nlohmann::json(nullptr) : nlohmann::json(uint64_t(limit.rlim_cur));
  j["hard_bytes"] = limit.rlim_max == RLIM_INFINITY ? nlohmann::json(nullptr)
                                                    : nlohmann::json(uint64_t(limit.rlim_max));
  // root holds CAP_IPC_LOCK (outside most containers): the limit does not apply to it.
  if (!unlimited && geteuid() != 0)
    AddProblem(report, "memlock",
               "memlock limit is " + Bytes(limit.rlim_cur) +
                   ": the store cannot lock its segments in RAM and workers stage copies "
                   "through small pinned buffers",
               "`ulimit -l unlimited` before starting (systemd: LimitMEMLOCK=infinity; "
               "/etc/security/limits.conf: `USER - memlock unlimited`)");
  return j;
}

nlohmann::json ShmCheck(nlohmann::json& report) {
  struct statvfs st {};
  if (statvfs("/dev/shm", &st) != 0) {
    AddProblem(report, "dev_shm", "/dev/shm is not mounted",
               "mount a tmpfs there: `mount -t tmpfs -o size=NG tmpfs /dev/shm`");
    return {{"path", "/dev/shm"}, {"mounted", false}};
  }
  const uint64_t size = uint64_t(st.f_blocks) * st.f_frsize;
  const uint64_t free = uint64_t(st.f_bavail) * st.f_frsize;
  if (size < kGiB)
    AddProblem(
        report, "dev_shm",
        "/dev/shm holds only " + Bytes(size) + ": a store needs room for the whole base model",
        "`mount -o remount,size=NG /dev/shm` (containers: docker run --shm-size=NG)");
  return {{"path", "/dev/shm"}, {"mounted", true}, {"size_bytes", size}, {"free_bytes", free}};
}

nlohmann::json HugePagesCheck(nlohmann::json& report) {
  std::ifstream in(kShmemHugeFile);
  std::string line;
  std::getline(in, line);
  std::string setting;  // the bracketed choice of "always within_size advise [never] deny force"
  const size_t open = line.find('['), close = line.find(']');
  if (open != std::string::npos && close != std::string::npos && close > open)
    setting = line.substr(open + 1, close - open - 1);
  if (setting == "never" || setting == "deny")
    AddProblem(report, "shmem_huge_pages",
               std::string("shared-memory huge pages are `") + setting +
                   "`: the store's segments use 4 KiB pages (slower registration and copies)",
               std::string("`echo advise > ") + kShmemHugeFile + "` as root");
  return {{"file", kShmemHugeFile},
          {"setting", setting.empty() ? nlohmann::json(nullptr) : nlohmann::json(setting)}};
}

nlohmann::json HostRegisterCheck(nlohmann::json& report, const DoctorOptions& o, size_t gpus) {
  if (!client::ThisBuild().cuda) {
    return {{"applicable", false}, {"detail", "not applicable: CPU build"}};
  }
  if (gpus == 0) return {{"applicable", false}, {"detail", "not applicable: no GPU"}};
  const std::string bin = o.bin_dir.empty() ? SelfExeDir() : o.bin_dir;
  int code = 0;
  std::string out;
  try {
    out = RunAndCapture({bin + "/lorastream-worker", "probe-host-register", "--device-index", "0"},
                        &code, std::max(30.0, o.timeout_s), "/dev/null");
  } catch (const Error& e) {
    out = e.what();  // could not run it (missing executable): said below
    code = -1;
  }
  nlohmann::json probe = nlohmann::json::parse(out, nullptr, false);
  nlohmann::json j{{"applicable", true},
                   {"probe", probe.is_object() ? probe : nlohmann::json(out)}};
  const bool ok = probe.is_object() && probe.value("ok", false) == true;
  j["ok"] = ok;
  if (!ok) {
    const std::string why =
        probe.is_object()
            ? probe.value("step", std::string("?")) + ": " + probe.value("error", std::string("?"))
            : "lorastream-worker probe-host-register exited " + std::to_string(code) +
                  (out.empty() ? "" : ": " + out);
    AddProblem(report, "host_register",
               "read-only host registration of a shared-memory mapping failed on cuda:0 (" + why +
                   "): workers fall back to staged copies",
               "raise the memlock limit (`ulimit -l unlimited`) and use a driver with "
               "cudaHostRegisterReadOnly (CUDA 11.1 or later)");
  }
  return j;
}

nlohmann::json StoresCheck(nlohmann::json& report) {
  nlohmann::json list = nlohmann::json::array();
  for (const store::StoreListing& s : store::ListStores()) {
    list.push_back({{"name", s.name},
                    {"state", store::StoreStateName(s)},
                    {"alive", s.alive},
                    {"bytes", StoreBytes(s)},
                    {"format", store::StoreFormat(s)},
                    {"pss_bytes", store::StorePssBytes(s)},
                    {"segments", s.objects.size()},
                    {"attached_pids", AttachedPids(s)}});
    if (!s.alive)
      AddProblem(report, "stores",
                 "store `" + s.name + "` left " + std::to_string(s.objects.size()) +
                     " shared-memory objects (" + Bytes(StoreBytes(s)) + ") behind a dead owner",
                 "`lorastream-store serve MODEL --name " + s.name +
                     "` removes them on start, or `rm /dev/shm/lorastream." + s.name + ".*`");
  }
  return list;
}

nlohmann::json CoordinatorCheck(nlohmann::json& report, const DoctorOptions& o) {
  nlohmann::json j{{"endpoint", o.endpoint}};
  // A folder that is not this user's own is a problem in itself, and is never connected to.
  if (std::string why = client::EndpointDirProblem(o.endpoint); !why.empty()) {
    j["reachable"] = false;
    j["error"] = why;
    const std::string dir = client::DefaultRuntimeDir();
    AddProblem(report, "coordinator", why,
               "remove " + dir + " as its owner or root (`sudo rm -r " + dir +
                   "`), then start `lorastream coordinator` as this user");
    return j;
  }
  try {
    client::Client client(
        client::ClientOptions{o.endpoint, o.curve_keys, static_cast<int>(o.timeout_s * 1000)});
    ListWorkersReply reply = client.Call(ListWorkersRequest{false});
    j["reachable"] = true;
    j["workers"] = reply.workers.size();
  } catch (const Error& e) {
    j["reachable"] = false;
    j["error"] = e.what();
    if (!o.expect_coordinator) {
      report["notes"].push_back(
          {{"check", "coordinator"},
           {"note", "no coordinator runs at " + o.endpoint},
           {"hint", "`lorastream up` starts a local cluster; `lorastream coordinator` one alone"}});
      return j;
    }
    AddProblem(report, "coordinator", "no coordinator answers at " + o.endpoint,
               "start one (`lorastream coordinator`, or `lorastream up --keep`), or point "
               "--coordinator / LORASTREAM_COORDINATOR at yours");
  }
  return j;
}

}  // namespace

nlohmann::json DoctorReport(const DoctorOptions& options) {
  nlohmann::json report{{"problems", nlohmann::json::array()}, {"notes", nlohmann::json::array()}};
  const std::vector<GpuInfo> gpus = ListGpus();
  report["build"] = BuildCheck(report, gpus.size());
  report["gpus"] = GpuCheck(gpus);
  report["memlock"] = MemlockCheck(report);
  report["dev_shm"] = ShmCheck(report);
  report["shmem_huge_pages"] = HugePagesCheck(report);
  report["host_register"] = HostRegisterCheck(report, options, gpus.size());
  report["stores"] = StoresCheck(report);
  report["coordinator"] = CoordinatorCheck(report, options);
  return report;
}

std::string DoctorText(const nlohmann::json& r) {
  std::ostringstream out;
  auto row = [&out](const char* name, const std::string& value) {
    char label[24];
    std::snprintf(label, sizeof label, "  %-15s", name);
    out << label << value << "\n";
  };
  out << "lorastream doctor\n";
  const auto& build = r["build"];
  row("build", build.value("summary", "") + (build.value("libtorch_dir", "").empty()
                                                 ? ""
                                                 : " (" + build.value("libtorch_dir", "") + ")"));
  if (r["gpus"].empty()) row("GPUs", "none");
  for (const auto& g : r["gpus"]) {
    const std::string name = g.value("name", "");
    std::string line = "cuda:" + std::to_string(g.value("index", 0)) + " " +
                       (name.empty() ? "(model unknown)" : name);
    if (g.value("memory_total_bytes", uint64_t{0}) > 0)
      line += ", " + Bytes(g.value("memory_total_bytes", uint64_t{0})) + " (" +
              Bytes(g.value("memory_used_bytes", uint64_t{0})) + " used)";
    if (!g.value("compute_capability", "").empty())
      line += ", compute " + g.value("compute_capability", "");
    row("GPU", line);
  }
  const auto& ml = r["memlock"];
  row("memlock", ml.value("unlimited", false)
                     ? "unlimited"
                     : Bytes(ml["soft_bytes"].get<uint64_t>()) +
                           (ml.value("root", false) ? " (root: not applied)" : ""));
  const auto& shm = r["dev_shm"];
  row("/dev/shm", shm.value("mounted", false)
                      ? Bytes(shm.value("size_bytes", uint64_t{0})) + ", " +
                            Bytes(shm.value("free_bytes", uint64_t{0})) + " free"
                      : "not mounted");
  const auto& hp = r["shmem_huge_pages"];
  row("shmem THP", hp["setting"].is_string() ? hp["setting"].get<std::string>() : "unknown");
  const auto& hr = r["host_register"];
  row("host register", !hr.value("applicable", false) ? hr.value("detail", "")
                       : hr.value("ok", false)        ? "read-only registration works on cuda:0"
                                                      : "FAILS on cuda:0");
  if (r["stores"].empty()) row("stores", "none published");
  for (const auto& s : r["stores"])
    row("store", s.value("name", "") + ": " + s.value("state", "") + ", " +
                     std::to_string(s.value("segments", 0)) + " segments, " +
                     Bytes(s.value("bytes", uint64_t{0})) +
                     (s.value("format", "").empty() ? "" : ", " + s.value("format", "")) + ", " +
                     std::to_string(s["attached_pids"].size()) + " attached, " +
                     Bytes(s.value("pss_bytes", uint64_t{0})) + " in RAM");
  const auto& c = r["coordinator"];
  row("coordinator", c.value("endpoint", "") + ": " +
                         (c.value("reachable", false)
                              ? "reachable, " + std::to_string(c.value("workers", 0)) + " worker(s)"
                              : std::string("not reachable")));
  if (r.contains("notes"))
    for (const auto& n : r["notes"])
      out << "  note: " << n.value("note", "") << " (" << n.value("hint", "") << ")\n";
  const auto& problems = r["problems"];
  if (problems.empty()) {
    out << "no problems found\n";
  } else {
    out << problems.size() << (problems.size() == 1 ? " problem:\n" : " problems:\n");
    for (const auto& p : problems)
      out << "  " << p.value("check", "") << ": " << p.value("problem", "")
          << "; fix: " << p.value("fix", "") << "\n";
  }
  return out.str();
}

int RunDoctor(const DoctorOptions& options, bool json, std::ostream& out) {
  const nlohmann::json report = DoctorReport(options);
  out << (json ? report.dump(2) + "\n" : DoctorText(report));
  return report["problems"].empty() ? 0 : 1;
}

}  // namespace lorastream::cli
