// The CPU backend of the ring: slots are host buffers and copies run on one worker thread,
// in the order they were issued. "Compute" is the calling thread itself, so a slot's release
// is complete the moment ReleaseSlot returns; AcquireSlot blocks the host until the slot's
// last copy has finished (the host-side analogue of the compute stream's event wait).
//
// It checks invariant 2 itself: a copy that would start while its slot is still being read
// (acquired and not released) is refused, and the error reaches the training thread at its
// next AcquireSlot / Drain.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "worker/stream/stream_backend.h"

namespace lorastream::worker {

class CpuStreamBackend : public StreamBackend {
 public:
  explicit CpuStreamBackend(const StreamBackendOptions& options);
  ~CpuStreamBackend() override;
  CpuStreamBackend(const CpuStreamBackend&) = delete;
  CpuStreamBackend& operator=(const CpuStreamBackend&) = delete;

  const at::Tensor& slot(int slot) const override { return slots_[slot]; }
  void AddSource(const uint8_t* src, uint64_t bytes) override {}
  at::Tensor MakeResident(const uint8_t* src, uint64_t bytes) override;
  void Copy(int slot, const uint8_t* src, uint64_t bytes) override;
  void FreeSlot(int slot) override;
  void AcquireSlot(int slot) override;
  void ReleaseSlot(int slot) override;
  void Drain() override;
  void CollectTimes(double* h2d_busy_seconds, double* stall_seconds) override;
  uint64_t PeakDeviceBytes() override { return 0; }
  void ResetPeak() override {}

  // Slots allocated now, and the most allocated at once since construction (tests check
  // the memory timeline with them).
  int live_slots();
  int max_live_slots();

 private:
  struct Job {
    int slot;
    const uint8_t* src;
    uint64_t bytes;
    uint64_t seq;
  };
  void CopyLoop();
  void RethrowCopyError();  // requires mu_
  void Allocate(int slot);  // requires mu_

  const StreamBackendOptions options_;
  std::vector<at::Tensor> slots_;  // written under mu_ (the copy thread reads them)
  int live_slots_ = 0;             // guarded by mu_
  int max_live_slots_ = 0;         // guarded by mu_

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> queue_;                 // guarded by mu_
  std::vector<uint64_t> slot_last_copy_;  // guarded by mu_: seq of the last copy into slot
  std::vector<bool> reading_;             // guarded by mu_: acquired and not yet released
  uint64_t issued_ = 0;                   // guarded by mu_: seq of the last issued copy
  uint64_t completed_ = 0;                // guarded by mu_: copies finish in issue order
  std::exception_ptr copy_error_;         // guarded by mu_
  bool stop_ = false;                     // guarded by mu_
  double busy_seconds_ = 0;               // guarded by mu_
  double stall_seconds_ = 0;              // training thread only
  std::thread thread_;
};

}  // namespace lorastream::worker
