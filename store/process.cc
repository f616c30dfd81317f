#include "store/process.h"

#include <dirent.h>
#include <signal.h>

#include <cerrno>
#include <fstream>
#include <sstream>

namespace lorastream::store {

namespace {

// Fields 3 (state) and 22 (start time) of /proc/PID/stat; false when there is no such process.
bool ReadProcessStat(int64_t pid, char* state, uint64_t* start_time) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string text;
  if (!in || !std::getline(in, text)) return false;
  // Field 2 (comm) may hold spaces and parentheses: skip to the last ')'.
  const size_t close = text.rfind(')');
  if (close == std::string::npos || close + 2 >= text.size()) return false;
  std::istringstream rest(text.substr(close + 2));
  std::string field;
  rest >> field;  // field 3
  *state = field.empty() ? '?' : field[0];
  for (int i = 4; i < 22 && rest >> field; ++i) {
  }
  *start_time = 0;
  rest >> *start_time;
  return true;
}

}  // namespace

uint64_t ProcessStartTime(int64_t pid) {
  char state = 0;
  uint64_t start = 0;
  return ReadProcessStat(pid, &state, &start) ? start : 0;
}

bool ProcessAlive(int64_t pid, uint64_t start_time) {
  if (pid <= 0) return false;
  if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return false;
  char state = 0;
  uint64_t now = 0;
  if (!ReadProcessStat(pid, &state, &now) || now == 0) return false;
  // A zombie (Z) or a dying process (X) holds its pid but will never serve again.
  if (state == 'Z' || state == 'X') return false;
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

ShmMappingUse ShmMappingUseOf(int64_t pid, const std::string& shm_prefix) {
  std::ifstream smaps("/proc/" + std::to_string(pid) + "/smaps");
  const std::string needle = "/dev/shm/" + shm_prefix;
  ShmMappingUse use;
  bool inside = false;
  for (std::string line; std::getline(smaps, line);) {
    // A mapping's header starts with its address range ("7f12a000-7f12b000 r--s ..."), the
    // fields that follow it with a name and a colon ("Pss:     1024 kB").
    const size_t dash = line.find('-');
    if (dash != std::string::npos && dash > 0 &&
        line.find_first_not_of("0123456789abcdef") == dash) {
      inside = line.find(needle) != std::string::npos;
      continue;
    }
    if (!inside) continue;
    if (line.rfind("Rss:", 0) == 0) use.rss_bytes += std::stoull(line.substr(4)) * 1024;
    if (line.rfind("Pss:", 0) == 0) use.pss_bytes += std::stoull(line.substr(4)) * 1024;
  }
  return use;
}

}  // namespace lorastream::store
