// Progress of loading a store, for a base that takes minutes to check, quantise and copy:
// bytes done of each phase's total, throughput and time left.
//
// The threads doing the work call Add() (one relaxed atomic add, no lock); one reporting
// thread calls Tick() (ProgressTicker does, a few times a second), which prints only when due:
// - on a terminal, one line rewritten in place at most every `terminal_period` seconds;
// - otherwise (a log file, systemd, `up`'s log), a log line once at least `log_period` seconds
//   AND `log_fraction` of the phase have passed since the last one, whichever is rarer;
// and nothing before `quiet_seconds` from the start, so that a small base loads with no
// progress lines at all. The clock is injected: tests drive the throttling without sleeping.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace lorastream::store {

// Where progress goes. Rewrite: the terminal's one progress line, replaced in place (an
// empty line clears it). Log: one line of the log.
class ProgressOutput {
 public:
  virtual ~ProgressOutput() = default;
  virtual void Rewrite(std::string_view line) = 0;
  virtual void Log(std::string_view line) = 0;
};

// stderr (`\r`, the line, erase to its end) and the process's logger (info).
class StderrProgressOutput : public ProgressOutput {
 public:
  void Rewrite(std::string_view line) override;
  void Log(std::string_view line) override;
};

struct ProgressOptions {
  bool terminal = false;         // rewrite one line (else: log lines)
  double quiet_seconds = 1.0;    // nothing shown before this long from the start
  double terminal_period = 0.2;  // seconds between rewrites of the terminal line
  double log_period = 5.0;       // at least this long between log lines...
  double log_fraction = 0.10;    // ...and at least this share of the phase between them
};

// One finished phase: what it was, its bytes (`done` equals `total` unless work was skipped)
// and its wall time.
struct PhaseTiming {
  std::string name;
  uint64_t total = 0;
  uint64_t done = 0;
  double seconds = 0;
};

// "reading: 5.20 / 14.00 GB (37%), 4.52 GB/s, 1.9 s left".
std::string DescribeProgress(std::string_view phase, uint64_t done, uint64_t total, double seconds);

// "12.3 s", "4 min 05 s", "1 h 02 min".
std::string FormatDuration(double seconds);

class Progress {
 public:
  using Clock = std::function<std::chrono::steady_clock::time_point()>;

  // `output` must outlive the Progress. The start (for quiet_seconds) is now.
  Progress(ProgressOutput& output, ProgressOptions options,
           Clock clock = std::chrono::steady_clock::now);
  // Clears the terminal line it left (a load that failed half-way ends no phase).
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  // Starts a phase of `total` bytes (the previous one must have ended; one that failed need
  // not be ended).
  void BeginPhase(std::string name, uint64_t total);
  // From any thread, while a phase runs.
  void Add(uint64_t bytes) { done_.fetch_add(bytes, std::memory_order_relaxed); }
  // Prints the running phase's state when it is due (see the top of this file).
  void Tick();
  // Ends the running phase (after a last Tick, so a long phase shows where it ended).
  PhaseTiming EndPhase();
  // Runs `log` (which writes other log lines) with the terminal line cleared; the next Tick
  // draws it again.
  void Aside(const std::function<void()>& log);
  // Clears the terminal line and logs `summary`.
  void Finish(std::string_view summary);

  std::vector<PhaseTiming> phases() const;

 private:
  using TimePoint = std::chrono::steady_clock::time_point;
  static double Seconds(TimePoint from, TimePoint to);
  void TickLocked(TimePoint now);

  ProgressOutput& output_;
  const ProgressOptions options_;
  const Clock clock_;
  const TimePoint start_;
  std::atomic<uint64_t> done_{0};

  mutable std::mutex mutex_;  // guards everything below (Tick runs beside the phase changes)
  bool running_ = false;
  std::string phase_;
  uint64_t total_ = 0;
  TimePoint phase_start_{};
  TimePoint last_shown_{};         // the last terminal rewrite or log line
  uint64_t done_at_last_log_ = 0;  // bytes of the phase at its last log line
  bool phase_shown_ = false;       // the running phase was shown
  bool line_shown_ = false;        // the terminal holds a progress line
  std::vector<PhaseTiming> phases_;
};

// Calls progress.Tick() every `period` on a thread of its own until destroyed.
class ProgressTicker {
 public:
  ProgressTicker(Progress& progress, std::chrono::milliseconds period);
  ~ProgressTicker();
  ProgressTicker(const ProgressTicker&) = delete;
  ProgressTicker& operator=(const ProgressTicker&) = delete;

 private:
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;  // guarded by mutex_
  std::thread thread_;
};

}  // namespace lorastream::store
