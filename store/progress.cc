#include "store/progress.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>

#include "common/base/error.h"
#include "common/base/log.h"

namespace lorastream::store {

void StderrProgressOutput::Rewrite(std::string_view line) {
  // \r returns to the line's start, \033[K erases what a longer previous line left after it.
  std::fprintf(stderr, "\r%.*s\033[K", static_cast<int>(line.size()), line.data());
  std::fflush(stderr);
}

void StderrProgressOutput::Log(std::string_view line) { LS_LOG_INFO("{}", line); }

std::string FormatDuration(double seconds) {
  char buf[48];
  if (seconds < 60) {
    std::snprintf(buf, sizeof buf, "%.1f s", seconds);
  } else if (seconds < 3600) {
    const long s = std::lround(seconds);
    std::snprintf(buf, sizeof buf, "%ld min %02ld s", s / 60, s % 60);
  } else {
    const long m = std::lround(seconds / 60);
    std::snprintf(buf, sizeof buf, "%ld h %02ld min", m / 60, m % 60);
  }
  return buf;
}

std::string DescribeProgress(std::string_view phase, uint64_t done, uint64_t total,
                             double seconds) {
  // Decimal units, as the rate's: bytes / (GB/s) reads as seconds.
  const bool gb = total >= 1000000000ull;
  const double unit = gb ? 1e9 : 1e6;
  char buf[160];
  int n = std::snprintf(buf, sizeof buf, "%.*s: %.2f / %.2f %s (%.0f%%)",
                        static_cast<int>(phase.size()), phase.data(), done / unit, total / unit,
                        gb ? "GB" : "MB", total > 0 ? std::floor(100.0 * done / total) : 100.0);
  std::string text(buf, static_cast<size_t>(n));
  if (done == 0 || seconds <= 0) return text + ", time left unknown";
  const double rate = done / seconds;
  n = std::snprintf(buf, sizeof buf, ", %.2f GB/s", rate / 1e9);
  text.append(buf, static_cast<size_t>(n));
  if (done < total) text += ", " + FormatDuration((total - done) / rate) + " left";
  return text;
}

Progress::Progress(ProgressOutput& output, ProgressOptions options, Clock clock)
    : output_(output), options_(options), clock_(std::move(clock)), start_(clock_()) {}

Progress::~Progress() {
  if (line_shown_) output_.Rewrite("");
}

double Progress::Seconds(TimePoint from, TimePoint to) {
  return std::chrono::duration<double>(to - from).count();
}

void Progress::BeginPhase(std::string name, uint64_t total) {
  const TimePoint now = clock_();
  std::lock_guard<std::mutex> lock(mutex_);
  running_ = true;
  phase_ = std::move(name);
  total_ = total;
  phase_start_ = now;
  last_shown_ = now;
  done_at_last_log_ = 0;
  phase_shown_ = false;
  done_.store(0, std::memory_order_relaxed);
}

void Progress::Tick() {
  const TimePoint now = clock_();
  std::lock_guard<std::mutex> lock(mutex_);
  TickLocked(now);
}

void Progress::TickLocked(TimePoint now) {
  if (!running_ || Seconds(start_, now) < options_.quiet_seconds) return;
  const uint64_t done = done_.load(std::memory_order_relaxed);
  const double since_shown = Seconds(last_shown_, now);
  if (options_.terminal) {
    // The first rewrite of a phase comes at once (the line names the new phase).
    if (line_shown_ && phase_shown_ && since_shown < options_.terminal_period) return;
    output_.Rewrite(DescribeProgress(phase_, done, total_, Seconds(phase_start_, now)));
    line_shown_ = true;
  } else {
    if (since_shown < options_.log_period ||
        static_cast<double>(done - done_at_last_log_) < options_.log_fraction * total_)
      return;
    output_.Log(DescribeProgress(phase_, done, total_, Seconds(phase_start_, now)));
    done_at_last_log_ = done;
  }
  last_shown_ = now;
  phase_shown_ = true;
}

PhaseTiming Progress::EndPhase() {
  const TimePoint now = clock_();
  std::lock_guard<std::mutex> lock(mutex_);
  LS_CHECK(running_, "a progress phase ends after it began");
  TickLocked(now);
  running_ = false;
  phases_.push_back(
      {phase_, total_, done_.load(std::memory_order_relaxed), Seconds(phase_start_, now)});
  return phases_.back();
}

void Progress::Aside(const std::function<void()>& log) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (line_shown_) output_.Rewrite("");
  line_shown_ = false;
  log();
}

void Progress::Finish(std::string_view summary) {
  Aside([&] { output_.Log(summary); });
}

std::vector<PhaseTiming> Progress::phases() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return phases_;
}

ProgressTicker::ProgressTicker(Progress& progress, std::chrono::milliseconds period) {
  thread_ = std::thread([this, &progress, period] {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!wake_.wait_for(lock, period, [this] { return stop_; })) {
      lock.unlock();
      progress.Tick();
      lock.lock();
    }
  });
}

ProgressTicker::~ProgressTicker() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_one();
  thread_.join();
}

}  // namespace lorastream::store
