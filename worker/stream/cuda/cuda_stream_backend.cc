#include "worker/stream/cuda/cuda_stream_backend.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include "common/base/error.h"
#include "worker/stream/copy_sources.h"
#include "worker/stream/cuda/cuda_handles.h"
#include "worker/stream/cuda/cuda_memory.h"

namespace lorastream::worker {

namespace {

using Clock = std::chrono::steady_clock;

void CUDART_CB SleepHostFunc(void* microseconds) {
  std::this_thread::sleep_for(std::chrono::microseconds(*static_cast<int64_t*>(microseconds)));
}

// Two timing events around a span of GPU work on one stream.
struct TimedSpan {
  CudaEvent start{true};
  CudaEvent end{true};
};

// A pool of spans reused every step: a step records tens of them.
class SpanPool {
 public:
  TimedSpan* Next() {
    if (used_ == spans_.size()) spans_.push_back(std::make_unique<TimedSpan>());
    return spans_[used_++].get();
  }
  // Sum of the recorded spans' durations (waits for each to complete); empties the pool.
  double CollectSeconds() {
    double total = 0;
    for (size_t i = 0; i < used_; ++i) {
      CudaCheck(cudaEventSynchronize(spans_[i]->end.get()), "cudaEventSynchronize (stats)");
      float ms = 0;
      CudaCheck(cudaEventElapsedTime(&ms, spans_[i]->start.get(), spans_[i]->end.get()),
                "cudaEventElapsedTime");
      total += ms / 1e3;
    }
    used_ = 0;
    return total;
  }

 private:
  std::vector<std::unique_ptr<TimedSpan>> spans_;
  size_t used_ = 0;
};

class CudaStreamBackend : public StreamBackend {
 public:
  CudaStreamBackend(const StreamBackendOptions& options, int device_index)
      : options_(options),
        device_index_(device_index),
        sources_(&registrar_, options.force_staging,
                 StagingPool{options.staging_buffers, options.staging_buffer_bytes}) {
    CudaCheck(cudaSetDevice(device_index_), "cudaSetDevice");
    copy_stream_ = std::make_unique<CudaStream>();
    const at::TensorOptions bytes_on_device = at::TensorOptions().dtype(at::kByte).device(
        c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device_index_)));
    const int permanent = options_.permanent_slots < 0
                              ? options_.num_slots
                              : std::min(options_.permanent_slots, options_.num_slots);
    slots_.resize(options_.num_slots);
    for (int s = 0; s < options_.num_slots; ++s) {
      // Exact size through the caching allocator: peak-memory statistics include the ring.
      if (s < permanent) {
        slots_[s] = at::empty({static_cast<int64_t>(options_.slot_bytes)}, bytes_on_device);
      }
      copied_.emplace_back(false);
      released_.emplace_back(false);
    }
    pending_wait_.assign(options_.num_slots, false);
    slot_job_.assign(options_.num_slots, 0);
  }

  ~CudaStreamBackend() override {
    if (staging_thread_.joinable()) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        stop_ = true;
      }
      cv_.notify_all();
      staging_thread_.join();
    }
    // Every copy into a slot must land before the slot's memory returns to the allocator.
    if (copy_stream_) cudaStreamSynchronize(copy_stream_->get());
  }

  const at::Tensor& slot(int slot) const override { return slots_[slot]; }

  void AddSource(const uint8_t* src, uint64_t bytes) override {
    if (sources_.Add(src, bytes) == CopyPath::kStaged) StartStaging();
  }

  at::Tensor MakeResident(const uint8_t* src, uint64_t bytes) override {
    at::Tensor t = at::empty({static_cast<int64_t>(bytes)}, slots_options());
    CudaCheck(cudaMemcpy(t.data_ptr(), src, bytes, cudaMemcpyHostToDevice),
              "cudaMemcpy (resident block)");
    return t;
  }

  void Copy(int slot, const uint8_t* src, uint64_t bytes) override {
    LS_CHECK(slot >= 0 && slot < options_.num_slots, "slot out of range");
    LS_CHECK(bytes <= options_.slot_bytes, "copy larger than a slot");
    const CopyPath path = sources_.PathOf(src);
    if (!slots_[slot].defined()) {
      // A phase slot: allocated on the compute stream (the caching allocator may hand out
      // memory that compute work enqueued so far still uses), so the copy waits for that
      // work through the slot's release event.
      slots_[slot] = at::empty({static_cast<int64_t>(options_.slot_bytes)}, slots_options());
      CudaCheck(cudaEventRecord(released_[slot].get(), ComputeStream()),
                "cudaEventRecord (slot allocated)");
    }
    TimedSpan* span = copy_spans_.Next();
    pending_wait_[slot] = true;
    if (path == CopyPath::kDirect) {
      EnqueueCopy(slot, span, [&] {
        CudaCheck(cudaMemcpyAsync(slots_[slot].data_ptr(), src, bytes, cudaMemcpyHostToDevice,
                                  copy_stream_->get()),
                  "cudaMemcpyAsync (ring slot)");
      });
      slot_job_[slot] = 0;
      return;
    }
    std::lock_guard<std::mutex> lock(mu_);
    RethrowStagingError();
    jobs_.push_back(Job{slot, src, bytes, span, ++jobs_issued_});
    slot_job_[slot] = jobs_issued_;
    cv_.notify_all();
  }

  void AcquireSlot(int slot) override {
    if (!pending_wait_[slot]) return;  // this copy was waited on by an earlier use
    if (slot_job_[slot] != 0) {
      // A staged copy: its events exist only once the staging thread has enqueued it.
      const auto start = Clock::now();
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return jobs_enqueued_ >= slot_job_[slot] || staging_error_; });
      RethrowStagingError();
      host_wait_seconds_ += std::chrono::duration<double>(Clock::now() - start).count();
    }
    cudaStream_t compute = ComputeStream();
    TimedSpan* span = stall_spans_.Next();
    CudaCheck(cudaEventRecord(span->start.get(), compute), "cudaEventRecord (stall start)");
    CudaCheck(cudaStreamWaitEvent(compute, copied_[slot].get(), 0),
              "cudaStreamWaitEvent (compute waits for copy)");
    CudaCheck(cudaEventRecord(span->end.get(), compute), "cudaEventRecord (stall end)");
    pending_wait_[slot] = false;
  }

  void FreeSlot(int slot) override {
    LS_CHECK(slot >= 0 && slot < options_.num_slots, "slot out of range");
    LS_CHECK(options_.permanent_slots >= 0 && slot >= options_.permanent_slots,
             "FreeSlot of a permanent ring slot");
    // The slot's readers were enqueued on the compute stream before this point, and they
    // waited for its copy: compute-stream reuse of the memory is ordered after both. A
    // staged copy's host thread still holding the slot cannot happen: compute acquired it.
    slots_[slot] = at::Tensor();
  }

  void ReleaseSlot(int slot) override {
    CudaCheck(cudaEventRecord(released_[slot].get(), ComputeStream()),
              "cudaEventRecord (slot released)");
  }

  void Drain() override {
    WaitStagingIdle();
    CudaCheck(cudaStreamSynchronize(copy_stream_->get()), "cudaStreamSynchronize (copy)");
  }

  void CollectTimes(double* h2d_busy_seconds, double* stall_seconds) override {
    WaitStagingIdle();
    *h2d_busy_seconds = copy_spans_.CollectSeconds();
    *stall_seconds = stall_spans_.CollectSeconds() + host_wait_seconds_;
    host_wait_seconds_ = 0;
  }

  uint64_t PeakDeviceBytes() override { return CudaPeakAllocatedBytes(device_index_); }

  void ResetPeak() override { CudaResetPeakAllocated(device_index_); }

 private:
  struct Job {
    int slot;
    const uint8_t* src;
    uint64_t bytes;
    TimedSpan* span;
    uint64_t seq;
  };

  at::TensorOptions slots_options() const {
    return at::TensorOptions().dtype(at::kByte).device(
        c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device_index_)));
  }

  cudaStream_t ComputeStream() const {
    return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_index_)).stream();
  }

  // The copy into `slot`, on the copy stream: wait for the slot's last release (invariant 2),
  // optional poison and delay, the timed copy itself, then the "copied" event.
  template <class CopyFn>
  void EnqueueCopy(int slot, TimedSpan* span, CopyFn copy) {
    cudaStream_t s = copy_stream_->get();
    CudaCheck(cudaStreamWaitEvent(s, released_[slot].get(), 0),
              "cudaStreamWaitEvent (copy waits for release)");
    // Busy time starts once the slot is free (the wait is not busy) and includes the test
    // hooks, which stand for a slower link.
    CudaCheck(cudaEventRecord(span->start.get(), s), "cudaEventRecord (copy start)");
    if (options_.debug_poison) {
      CudaCheck(cudaMemsetAsync(slots_[slot].data_ptr(), 0xFF, options_.slot_bytes, s),
                "cudaMemsetAsync (poison)");
    }
    if (options_.debug_copy_delay_us > 0) {
      CudaCheck(
          cudaLaunchHostFunc(s, SleepHostFunc, const_cast<int64_t*>(&options_.debug_copy_delay_us)),
          "cudaLaunchHostFunc (delay)");
    }
    copy();
    CudaCheck(cudaEventRecord(span->end.get(), s), "cudaEventRecord (copy end)");
    CudaCheck(cudaEventRecord(copied_[slot].get(), s), "cudaEventRecord (slot copied)");
  }

  void StartStaging() {
    if (staging_thread_.joinable()) return;
    const size_t bytes = std::max<uint64_t>(uint64_t{1} << 20, options_.staging_buffer_bytes);
    for (int i = 0; i < std::max(2, options_.staging_buffers); ++i) {
      staging_.emplace_back(bytes);
      staging_free_.emplace_back(false);
    }
    staging_thread_ = std::thread([this] { StagingLoop(); });
  }

  // Copies each staged job chunk by chunk: host memcpy into a pinned buffer (after the GPU
  // finished reading that buffer's previous chunk), then an async H2D from it.
  void StagingLoop() {
    cudaSetDevice(device_index_);
    size_t next_buffer = 0;
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;
      const Job job = jobs_.front();
      jobs_.pop_front();
      const bool failed_before = staging_error_ != nullptr;  // then nothing more is copied
      lock.unlock();
      std::exception_ptr error;
      try {
        if (!failed_before) {
          EnqueueCopy(job.slot, job.span, [&] {
            for (uint64_t off = 0; off < job.bytes;) {
              const PinnedBuffer& buf = staging_[next_buffer];
              const cudaEvent_t free = staging_free_[next_buffer].get();
              next_buffer = (next_buffer + 1) % staging_.size();
              const uint64_t n = std::min<uint64_t>(buf.size(), job.bytes - off);
              CudaCheck(cudaEventSynchronize(free), "cudaEventSynchronize (staging)");
              std::memcpy(buf.data(), job.src + off, n);
              CudaCheck(cudaMemcpyAsync(static_cast<uint8_t*>(slots_[job.slot].data_ptr()) + off,
                                        buf.data(), n, cudaMemcpyHostToDevice, copy_stream_->get()),
                        "cudaMemcpyAsync (staged)");
              CudaCheck(cudaEventRecord(free, copy_stream_->get()), "cudaEventRecord (staging)");
              off += n;
            }
          });
        }
      } catch (...) {
        error = std::current_exception();
      }
      lock.lock();
      if (error && !staging_error_) staging_error_ = error;
      jobs_enqueued_ = job.seq;
      cv_.notify_all();
    }
  }

  void WaitStagingIdle() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return jobs_enqueued_ >= jobs_issued_ || staging_error_; });
    RethrowStagingError();
  }

  void RethrowStagingError() {
    if (staging_error_) std::rethrow_exception(staging_error_);
  }

  const StreamBackendOptions options_;
  const int device_index_;
  std::unique_ptr<CudaStream> copy_stream_;
  std::vector<at::Tensor> slots_;
  std::vector<CudaEvent> copied_;    // [slot] recorded on the copy stream behind each copy
  std::vector<CudaEvent> released_;  // [slot] recorded on the compute stream at each release
  std::vector<bool> pending_wait_;   // [slot] a copy compute has not waited for yet
  std::vector<uint64_t> slot_job_;   // [slot] staged job of the last copy (0: direct)
  CudaHostRegistrar registrar_;
  CopySources sources_;  // after registrar_: its registrations are released first
  SpanPool copy_spans_, stall_spans_;
  double host_wait_seconds_ = 0;

  // Staging fallback.
  std::vector<PinnedBuffer> staging_;
  std::vector<CudaEvent> staging_free_;  // recorded behind the H2D that reads the buffer
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;              // guarded by mu_
  uint64_t jobs_issued_ = 0;          // guarded by mu_
  uint64_t jobs_enqueued_ = 0;        // guarded by mu_
  std::exception_ptr staging_error_;  // guarded by mu_
  bool stop_ = false;                 // guarded by mu_
  std::thread staging_thread_;
};

}  // namespace

std::unique_ptr<StreamBackend> MakeCudaStreamBackend(const StreamBackendOptions& options,
                                                     int device_index) {
  return std::make_unique<CudaStreamBackend>(options, device_index);
}

}  // namespace lorastream::worker
