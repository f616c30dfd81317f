#include "worker/stream/stream_cpu_backend.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

#include "common/base/error.h"

namespace lorastream::worker {

namespace {
using Clock = std::chrono::steady_clock;
double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }
}  // namespace

CpuStreamBackend::CpuStreamBackend(const StreamBackendOptions& options)
    : options_(options), slot_last_copy_(options.num_slots, 0), reading_(options.num_slots, false) {
  LS_CHECK(options.num_slots >= 0, "negative slot count");
  slots_.resize(options.num_slots);
  const int permanent = options.permanent_slots < 0
                            ? options.num_slots
                            : std::min(options.permanent_slots, options.num_slots);
  for (int s = 0; s < permanent; ++s) Allocate(s);  // no thread yet: no lock needed
  thread_ = std::thread([this] { CopyLoop(); });
}

void CpuStreamBackend::Allocate(int slot) {
  slots_[slot] = at::empty({static_cast<int64_t>(options_.slot_bytes)}, at::kByte);
  max_live_slots_ = std::max(max_live_slots_, ++live_slots_);
}

int CpuStreamBackend::live_slots() {
  std::lock_guard<std::mutex> lock(mu_);
  return live_slots_;
}

int CpuStreamBackend::max_live_slots() {
  std::lock_guard<std::mutex> lock(mu_);
  return max_live_slots_;
}

void CpuStreamBackend::FreeSlot(int slot) {
  LS_CHECK(slot >= 0 && slot < options_.num_slots, "slot out of range");
  LS_CHECK(options_.permanent_slots >= 0 && slot >= options_.permanent_slots,
           "FreeSlot of a permanent ring slot");
  std::unique_lock<std::mutex> lock(mu_);
  if (reading_[slot]) {
    throw Error(ErrorCode::kInternal, "invariant 2 broken: ring slot " + std::to_string(slot) +
                                          " freed while a block in it was still being read");
  }
  // A copy still writing the slot finishes first (the plan never frees a slot before its
  // block's use, so this does not wait in practice).
  const uint64_t wanted = slot_last_copy_[slot];
  cv_.wait(lock, [&] { return completed_ >= wanted || copy_error_; });
  if (!slots_[slot].defined()) return;
  slots_[slot] = at::Tensor();
  --live_slots_;
}

CpuStreamBackend::~CpuStreamBackend() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();  // the loop finishes the queued copies first: slots outlive every write
}

at::Tensor CpuStreamBackend::MakeResident(const uint8_t* src, uint64_t bytes) {
  // Base weights are never written (invariant 3): the view is only ever read.
  return at::from_blob(const_cast<uint8_t*>(src), {static_cast<int64_t>(bytes)}, at::kByte);
}

void CpuStreamBackend::Copy(int slot, const uint8_t* src, uint64_t bytes) {
  LS_CHECK(slot >= 0 && slot < options_.num_slots, "slot out of range");
  LS_CHECK(bytes <= options_.slot_bytes, "copy larger than a slot");
  {
    std::lock_guard<std::mutex> lock(mu_);
    RethrowCopyError();
    if (!slots_[slot].defined()) Allocate(slot);
    queue_.push_back(Job{slot, src, bytes, ++issued_});
    slot_last_copy_[slot] = issued_;
  }
  cv_.notify_all();
}

void CpuStreamBackend::AcquireSlot(int slot) {
  std::unique_lock<std::mutex> lock(mu_);
  const auto start = Clock::now();
  const uint64_t wanted = slot_last_copy_[slot];
  cv_.wait(lock, [&] { return completed_ >= wanted || copy_error_; });
  stall_seconds_ += Seconds(Clock::now() - start);
  RethrowCopyError();
  reading_[slot] = true;
}

void CpuStreamBackend::ReleaseSlot(int slot) {
  std::lock_guard<std::mutex> lock(mu_);
  reading_[slot] = false;
}

void CpuStreamBackend::Drain() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return completed_ >= issued_ || copy_error_; });
  RethrowCopyError();
}

void CpuStreamBackend::CollectTimes(double* h2d_busy_seconds, double* stall_seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  *h2d_busy_seconds = busy_seconds_;
  *stall_seconds = stall_seconds_;
  busy_seconds_ = 0;
  stall_seconds_ = 0;
}

void CpuStreamBackend::RethrowCopyError() {
  if (copy_error_) std::rethrow_exception(copy_error_);
}

void CpuStreamBackend::CopyLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stop_ and nothing left to copy
    const Job job = queue_.front();
    queue_.pop_front();
    if (copy_error_) {  // after an error nothing more is written; waiters see the error
      completed_ = job.seq;
      cv_.notify_all();
      continue;
    }
    if (reading_[job.slot]) {
      copy_error_ = std::make_exception_ptr(
          Error(ErrorCode::kInternal, "invariant 2 broken: a copy into ring slot " +
                                          std::to_string(job.slot) +
                                          " was issued while a block in it was still being read"));
      completed_ = job.seq;
      cv_.notify_all();
      continue;
    }
    uint8_t* dst = slots_[job.slot].data_ptr<uint8_t>();
    lock.unlock();
    const auto start = Clock::now();
    if (options_.debug_poison) std::memset(dst, 0xFF, options_.slot_bytes);
    if (options_.debug_after_poison) options_.debug_after_poison(job.slot);
    if (options_.debug_copy_delay_us > 0) {
      std::this_thread::sleep_for(std::chrono::microseconds(options_.debug_copy_delay_us));
    }
    std::memcpy(dst, job.src, job.bytes);
    const double seconds = Seconds(Clock::now() - start);
    lock.lock();
    busy_seconds_ += seconds;
    completed_ = job.seq;
    cv_.notify_all();
  }
}

}  // namespace lorastream::worker
