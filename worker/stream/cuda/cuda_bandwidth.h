// Pinned Host->Device bandwidth over given host ranges (the store's blocks), measured the way
// the engine copies: ranges registered read-only, one cudaMemcpyAsync per range on a
// non-blocking stream, timed with events. Header free of CUDA and torch (the benchmark uses it).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace lorastream::worker {

// GB/s (1e9 bytes per second) over `repeats` passes across every range. Error(kResource)
// when a range cannot be registered.
double MeasurePinnedH2DBandwidth(const std::vector<std::pair<const uint8_t*, uint64_t>>& ranges,
                                 int device_index, int repeats);

}  // namespace lorastream::worker
