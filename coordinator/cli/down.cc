#include "coordinator/cli/down.h"

#include <signal.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "common/base/error.h"
#include "coordinator/client/curve.h"

namespace lorastream::cli {
namespace {

namespace fs = std::filesystem;

constexpr const char* kRecordPrefix = "up-";
constexpr const char* kRecordSuffix = ".cluster";

std::string ReadText(const std::string& path) {
  std::ifstream in(path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// Whether `pid` is a live (not zombie) process running a lorastream executable: a pid
// recorded long ago may belong to another program by now, which `down` must not signal.
bool IsLorastreamProcess(pid_t pid) {
  if (pid <= 0 || ::kill(pid, 0) != 0) return false;
  const std::string stat = ReadText("/proc/" + std::to_string(pid) + "/stat");
  const size_t paren = stat.rfind(')');
  if (paren != std::string::npos && paren + 2 < stat.size() && stat[paren + 2] == 'Z') return false;
  std::string cmdline = ReadText("/proc/" + std::to_string(pid) + "/cmdline");
  std::replace(cmdline.begin(), cmdline.end(), '\0', ' ');
  return cmdline.find("lorastream") != std::string::npos;
}

bool WaitGone(pid_t pid, double timeout_s) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (IsLorastreamProcess(pid)) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return true;
}

// The record files naming `run_dir` ("" = every one).
std::vector<fs::path> Records(const std::string& run_dir) {
  std::vector<fs::path> found;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(client::DefaultRuntimeDir(), ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(kRecordPrefix, 0) != 0 || e.path().extension() != kRecordSuffix) continue;
    std::string dir = ReadText(e.path().string());
    while (!dir.empty() && (dir.back() == '\n' || dir.back() == ' ')) dir.pop_back();
    if (run_dir.empty() || dir == run_dir) found.push_back(e.path());
  }
  std::sort(found.begin(), found.end(), [](const fs::path& a, const fs::path& b) {
    std::error_code ec;
    return fs::last_write_time(a, ec) < fs::last_write_time(b, ec);
  });
  return found;
}

}  // namespace

void WriteUpRecord(const std::string& run_dir) {
  const std::string dir = client::DefaultRuntimeDir();
  client::EnsureOwnerOnlyDir(dir);
  const std::string path = dir + "/" + kRecordPrefix + std::to_string(::getpid()) + kRecordSuffix;
  std::ofstream out(path);
  out << fs::absolute(run_dir).lexically_normal().string() << "\n";
  if (!out) throw Error(ErrorCode::kIo, "cannot write " + path);
}

std::vector<std::string> RecordedClusters() {
  std::vector<std::string> dirs;
  for (const fs::path& p : Records("")) {
    std::string dir = ReadText(p.string());
    while (!dir.empty() && (dir.back() == '\n' || dir.back() == ' ')) dir.pop_back();
    dirs.push_back(dir);
  }
  return dirs;
}

int RunDown(const std::string& run_dir_arg, double grace_s, std::ostream& out) {
  std::string run_dir =
      run_dir_arg.empty() ? "" : fs::absolute(run_dir_arg).lexically_normal().string();
  while (run_dir.size() > 1 && run_dir.back() == '/') run_dir.pop_back();
  if (run_dir.empty()) {
    const std::vector<std::string> all = RecordedClusters();
    if (all.empty())
      throw Error(ErrorCode::kNotFound,
                  "no cluster of `lorastream up --detach` (or --keep) is recorded in " +
                      client::DefaultRuntimeDir() + "; name its run folder: lorastream down DIR");
    if (all.size() > 1) {
      std::string list;
      for (const std::string& d : all) list += "\n  " + d;
      throw Error(ErrorCode::kInvalidArgument,
                  std::to_string(all.size()) +
                      " clusters run; name the one to stop (lorastream down DIR):" + list);
    }
    run_dir = all.front();
  }
  const std::string file = run_dir + "/cluster.json";
  std::error_code ec;
  if (!fs::exists(file, ec))
    throw Error(ErrorCode::kNotFound,
                file + " does not exist: " + run_dir +
                    " is not the run folder of a cluster that `lorastream up --detach` (or "
                    "--keep) left running");
  const nlohmann::json j = nlohmann::json::parse(ReadText(file), nullptr, false);
  if (!j.is_object() || !j.contains("parts") || !j["parts"].is_array())
    throw Error(ErrorCode::kCorrupt, file + " is not a cluster description (damaged?)");
  int stopped = 0;
  for (const auto& part : j["parts"]) {
    const pid_t pid = part.value("pid", 0);
    const std::string name = part.value("part", "?");
    if (!IsLorastreamProcess(pid)) continue;  // already gone
    ::kill(pid, SIGTERM);
    if (!WaitGone(pid, grace_s)) {
      out << name << " (pid " << pid << ") did not stop within " << grace_s << " s: killing it\n";
      ::kill(pid, SIGKILL);
      WaitGone(pid, 10);
    }
    out << "stopped " << name << " (pid " << pid << ")\n";
    ++stopped;
  }
  // A coordinator stopped by SIGKILL leaves its socket file behind.
  const std::string endpoint = j.value("endpoint", "");
  if (endpoint.rfind("ipc://", 0) == 0) fs::remove(endpoint.substr(6), ec);
  for (const fs::path& record : Records(run_dir)) fs::remove(record, ec);
  fs::remove(file, ec);
  out << (stopped ? "cluster stopped" : "nothing was running") << "; logs in " << run_dir
      << "/logs\n";
  return 0;
}

}  // namespace lorastream::cli
