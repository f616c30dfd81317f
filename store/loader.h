// Filling a store's segments from the checkpoint, in parallel.
//
// The unit of work is one checksum chunk (kChecksumChunkBytes) of one segment: a thread
// pread()s every tensor piece that falls into the chunk from the page cache straight into
// the segment (through a small buffer when converting to BF16), then hashes the chunk while
// it is still in cache. Padding between tensors stays zero (fresh tmpfs pages), so the
// checksum is a pure function of the weights and the layout.
#pragma once

#include <functional>
#include <vector>

#include "store/layout.h"
#include "store/shm_segment.h"

namespace lorastream::store {

class Progress;

struct LoadResult {
  uint64_t bytes = 0;  // bytes written into segments
  double seconds = 0;  // wall time of the load
};

// segments[i] backs plan.manifest.blocks[i]; segments.back() backs the rest. Writes each
// segment's checksum into plan.manifest. `should_stop` is polled between chunks, by every
// loading thread at once (so it must be thread-safe); when it returns true the load throws
// Error(kCancelled).
// The pieces of the plan whose bytes are computed rather than copied: each weight of
// plan.quantize quantised (with its scales) into its block's segment, in parallel over tiles
// of every weight, and plan.literals; to be called before LoadSegments, which hashes them
// with the rest. Returns the source bytes quantised and the time it took.
// `progress` (optional) gets a phase of each: "quantising to fp8" over the source bytes
// quantised, "reading" over the store's bytes (copied or converted, and hashed).
LoadResult QuantizeSegments(const PackPlan& plan, const std::vector<ShmSegment*>& segments,
                            int threads, const std::function<bool()>& should_stop,
                            Progress* progress = nullptr);

LoadResult LoadSegments(PackPlan& plan, const std::vector<ShmSegment*>& segments, int threads,
                        const std::function<bool()>& should_stop, Progress* progress = nullptr);

}  // namespace lorastream::store
