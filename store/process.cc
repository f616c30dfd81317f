#include "store/process.h"

#include <dirent.h>
#include <signal.h>

#include <cerrno>
#include <fstream>
#include <sstream>

namespace lorastream {

uint64_t ProcessStartTime(int64_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string text;
  if (!in || !std::getline(in, text)) return 0;
  // Field 2 (comm) may hold spaces and parentheses: skip to the last ')'.
  const size_t close = text.rfind(')');
  if (close == std::string::npos) return 0;
  std::istringstream rest(text.substr(close + 2));
  std::string field;
  for (int i = 3; i < 22 && rest >> field; ++i) {
  }
  uint64_t start = 0;
  rest >> start;
  return start;
}

bool ProcessAlive(int64_t pid, uint64_t start_time) {
  if (pid <= 0) return false;
  if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return false;
  const uint64_t now = ProcessStartTime(pid);
  if (now == 0) return false;  // gone (or a zombie being reaped)
  return start_time == 0 || now == start_time;
}

std::vector<int64_t> PidsMapping(const std::string& shm_prefix) {
  std::vector<int64_t> pids;
  DIR* proc = ::opendir("/proc");
  if (!proc) return pids;
  const std::string needle = "/dev/shm/" + shm_prefix;
  while (dirent* entry = ::readdir(proc)) {
    char* end = nullptr;
    const long pid = std::strtol(entry->d_name, &end, 10);
    if (*end != '\0' || pid <= 0) continue;
    std::ifstream maps(std::string("/proc/") + entry->d_name + "/maps");
    std::string line;
    while (std::getline(maps, line)) {
      if (line.find(needle) != std::string::npos) {
        pids.push_back(pid);
        break;
      }
    }
  }
  ::closedir(proc);
  return pids;
}

}  // namespace lorastream
