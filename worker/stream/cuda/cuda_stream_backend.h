// The CUDA backend of the ring (compiled only when CMake finds a CUDA LibTorch). This header
// is free of CUDA runtime headers so that worker/stream/stream_engine.cc can name the factory.
//
// - each streamed block's host range is prefaulted and registered (read-only, portable);
//   copies then run at full PCIe speed straight from the store's shared memory;
// - one non-blocking copy stream; per slot a "copied" event (recorded behind the slot's copy;
//   the compute stream waits on it, never the host) and a "released" event (recorded on the
//   compute stream at the release of each reader; the copy stream waits on it before it
//   overwrites the slot);
// - where registration fails (a memlock limit), copies go through a small pool of pinned
//   staging buffers filled by a host thread; the log says so once;
// - statistics from events: H2D busy (events around each copy on the copy stream), stall
//   (events on the compute stream just before and after its wait on a copy), peak memory
//   from the caching allocator (the slots are allocated through it).
#pragma once

#include <memory>

#include "worker/stream/stream_backend.h"

namespace lorastream::worker {

std::unique_ptr<StreamBackend> MakeCudaStreamBackend(const StreamBackendOptions& options,
                                                     int device_index);

}  // namespace lorastream::worker
