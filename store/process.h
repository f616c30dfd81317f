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

}  // namespace lorastream::store
