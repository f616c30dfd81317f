#include "worker/stream_cpu_backend.h"

#include <chrono>
#include <cstring>

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

#include "common/error.h"

namespace lorastream {

namespace {
using Clock = std::chrono::steady_clock;
double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }
}  // namespace

CpuStreamBackend::CpuStreamBackend(const StreamBackendOptions& options)
    : options_(options),
      slot_last_copy_(options.num_slots, 0),
      reading_(options.num_slots, false) {
  LS_CHECK(options.num_slots >= 0, "negative slot count");
  for (int s = 0; s < options.num_slots; ++s) {
    slots_.push_back(at::empty({static_cast<int64_t>(options.slot_bytes)}, at::kByte));
  }
  thread_ = std::thread([this] { CopyLoop(); });
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
      copy_error_ = std::make_exception_ptr(Error(
          ErrorCode::kInternal,
          "invariant 2 broken: a copy into ring slot " + std::to_string(job.slot) +
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

}  // namespace lorastream
