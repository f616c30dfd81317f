// What the ring needs from a device: slots, an asynchronous copy queue, and the two events
// that gate it. The ring logic (worker/stream/stream_engine.cc) is shared; a backend only moves
// bytes and orders work:
//   Copy(slot)        the copy starts only after the compute work recorded by the slot's last
//                     ReleaseSlot has completed (invariant 2);
//   AcquireSlot(slot) compute waits for the slot's last copy (invariant 1) — on CUDA the
//                     compute stream waits on the copy's event, never the host;
//   FreeSlot(slot)    a phase slot's memory goes back to the device's allocator after its
//                     last release (compute may reuse it at once: the slot's readers are
//                     ordered before it); the next Copy into it allocates it again, ordered
//                     after the compute work enqueued so far.
// Backends: CPU (worker/stream/stream_cpu_backend.h, a copy thread; what CI tests) and CUDA
// (worker/stream/cuda/cuda_stream_backend.h).
#pragma once

#include <cstdint>
#include <functional>

#include <ATen/core/Tensor.h>

namespace lorastream::worker {

struct StreamBackendOptions {
  int num_slots = 0;
  // Slots 0..permanent_slots-1 are allocated at construction and never freed; the others
  // (phase slots) on their first Copy and again after each FreeSlot. -1: all of them.
  int permanent_slots = -1;
  uint64_t slot_bytes = 0;  // the largest streamed block
  // Fill a slot with 0xFF bytes (NaN as bf16, f16 and f32) before each copy into it, so that
  // a read before the copy completed shows up as NaN in the results.
  bool debug_poison = false;
  // Delay each copy by this long (after the poison), to widen every race window in tests.
  int64_t debug_copy_delay_us = 0;
  // CPU: called on the copy thread after the poison, before the bytes are copied, so that a
  // test can hold a copy at that point and look at the slot (the poison's own test).
  std::function<void(int slot)> debug_after_poison;
  // CUDA: copy through the pinned staging pool even when registration succeeds (tests).
  bool force_staging = false;
  uint64_t staging_buffer_bytes = uint64_t{64} << 20;  // CUDA staging: bytes per buffer
  int staging_buffers = 3;                             // CUDA staging: buffers in the pool
};

class StreamBackend {
 public:
  virtual ~StreamBackend() = default;

  // A uint8 tensor of slot_bytes on the device: the ring slot `slot` (undefined while a phase
  // slot is freed).
  virtual const at::Tensor& slot(int slot) const = 0;
  // Prepares a streamed block's host range for copies (CUDA: prefault and register).
  virtual void AddSource(const uint8_t* src, uint64_t bytes) = 0;
  // A device tensor with the block's bytes, kept for the engine's life (CPU: a view, no copy).
  virtual at::Tensor MakeResident(const uint8_t* src, uint64_t bytes) = 0;

  // Enqueues the copy of [src, src + bytes) into `slot` (bytes <= slot_bytes), allocating the
  // slot first when it is freed.
  virtual void Copy(int slot, const uint8_t* src, uint64_t bytes) = 0;
  // Releases a phase slot's memory; its last use has been released. Error(kInternal) for a
  // slot still being read (CPU) or a permanent slot.
  virtual void FreeSlot(int slot) = 0;
  // Compute is about to read `slot`: make it wait for the slot's last copy.
  virtual void AcquireSlot(int slot) = 0;
  // Every kernel reading `slot` for this use has been enqueued on the compute stream.
  virtual void ReleaseSlot(int slot) = 0;
  // Blocks the host until every copy enqueued so far has completed.
  virtual void Drain() = 0;

  // Copy-engine busy time and compute stall time since the previous call, in seconds; may
  // wait for the device to finish the work enqueued so far.
  virtual void CollectTimes(double* h2d_busy_seconds, double* stall_seconds) = 0;
  // Peak device memory since ResetPeak (0 where the device does not track it).
  virtual uint64_t PeakDeviceBytes() = 0;
  virtual void ResetPeak() = 0;
};

}  // namespace lorastream::worker
