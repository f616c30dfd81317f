// Process identity for stale-store detection: a pid plus its start time, so that a recycled
// pid is not mistaken for the store that died.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace lorastream::store {

// Start time of `pid` in clock ticks since boot (/proc/PID/stat field 22); 0 when the
// process does not exist.
uint64_t ProcessStartTime(int64_t pid);

// True while the process `pid` that started at `start_time` (0: any start time) is running;
// a zombie (exited, not yet reaped by its parent) counts as dead.
bool ProcessAlive(int64_t pid, uint64_t start_time);

// Pids whose /proc/PID/maps maps a /dev/shm object whose name starts with `shm_prefix`.
std::vector<int64_t> PidsMapping(const std::string& shm_prefix);

// What `pid`'s mappings of the /dev/shm objects whose names start with `shm_prefix` hold in
// RAM, from /proc/PID/smaps: resident bytes (Rss) and their proportional share (Pss: a page
// mapped by n processes counts 1/n in each, so the Pss of every process mapping a store sums
// to the RAM the store takes, however many map it). Zeros when the process is gone or its
// smaps is not readable (another user's).
struct ShmMappingUse {
  uint64_t rss_bytes = 0;
  uint64_t pss_bytes = 0;
};
ShmMappingUse ShmMappingUseOf(int64_t pid, const std::string& shm_prefix);

}  // namespace lorastream::store
