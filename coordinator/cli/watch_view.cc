#include "coordinator/cli/watch_view.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <set>
#include <sstream>

#include "common/base/format_bytes.h"
#include "common/base/terminal_text.h"
#include "coordinator/cli/cli_format.h"

namespace lorastream::cli {
namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string Metrics(const JobSummary& j) {
  if (!j.has_stats) return "";
  const StepStats& s = j.last_stats;
  double stall = s.step_seconds > 0 ? 100.0 * s.stall_seconds / s.step_seconds : 0.0;
  double h2d = s.h2d_busy_seconds > 0 ? s.h2d_bytes / s.h2d_busy_seconds / 1e9 : 0.0;
  char buf[200];
  std::snprintf(buf, sizeof(buf), "loss %.4f  %.0f tok/s  stall %.1f%%  H2D %.2f GB/s", s.loss,
                s.tokens_per_second, stall, h2d);
  std::string text = buf;
  if (j.last_eval_step > 0) {
    std::snprintf(buf, sizeof(buf), "  eval %.4f @%lld", j.last_eval_loss,
                  static_cast<long long>(j.last_eval_step));
    text += buf;
  }
  return text;
}

std::string Bar(const JobSummary& j, int width) {
  double frac = j.total_steps > 0 ? std::clamp(double(j.step) / j.total_steps, 0.0, 1.0) : 0.0;
  if (j.state == JobState::kSucceeded) frac = 1.0;
  int filled = static_cast<int>(frac * width + 0.5);
  return "[" + std::string(filled, '#') + std::string(width - filled, '.') + "] " +
         std::to_string(static_cast<int>(frac * 100 + 0.5)) + "%";
}

bool Watched(const std::vector<int64_t>& watched, int64_t id) {
  return watched.empty() || std::find(watched.begin(), watched.end(), id) != watched.end();
}

}  // namespace

void TokenRateSmoother::Apply(WatchReply& reply) {
  for (JobSummary& j : reply.jobs) {
    if (!j.has_stats) continue;
    State& s = jobs_[j.id];
    if (s.attempt != j.attempt) s = State{-1, j.attempt, 0, 0};  // a new run: start afresh
    if (j.last_stats.step != s.step) {
      const double w = s.samples <= 1 ? 1.0 : kWeight;
      s.tokens_per_second = w * j.last_stats.tokens_per_second + (1 - w) * s.tokens_per_second;
      s.step = j.last_stats.step;
      ++s.samples;
    }
    j.last_stats.tokens_per_second = s.tokens_per_second;
  }
}

std::string RenderLine(const JobSummary& j) {
  std::ostringstream out;
  out << "job " << j.id << " " << TerminalSafe(j.name) << ": " << JobStateName(j.state) << " "
      << FormatProgress(j);
  if (j.state == JobState::kRunning) {
    out << " ETA " << FormatDuration(j.eta_seconds);
    std::string m = Metrics(j);
    if (!m.empty()) out << "  " << m;
    out << "  on " << TerminalSafe(j.worker_host + " " + j.worker_device);
  }
  if (!j.reason.empty()) out << " (" << TerminalSafe(j.reason) << ")";
  if (j.state == JobState::kSucceeded && !j.adapter_path.empty())
    out << " adapter: " << TerminalSafe(j.adapter_path);
  return out.str();
}

std::string RenderFrame(const WatchReply& reply, const std::vector<int64_t>& watched, int width) {
  std::ostringstream out;
  int bar = std::clamp(width - 60, 10, 40);
  out << "lorastream watch   (Ctrl-C leaves; jobs keep running)\n\n";
  for (const JobSummary& j : reply.jobs) {
    if (!Watched(watched, j.id)) continue;
    out << "job " << j.id << " " << TerminalSafe(j.name) << "  " << JobStateName(j.state) << "  "
        << Bar(j, bar) << "  " << FormatProgress(j);
    if (j.state == JobState::kRunning) out << "  ETA " << FormatDuration(j.eta_seconds);
    out << "\n";
    std::string m = Metrics(j);
    if (j.state == JobState::kRunning && !m.empty())
      out << "    " << m << "  on " << TerminalSafe(j.worker_host + " " + j.worker_device) << "\n";
    if (!j.reason.empty()) out << "    " << TerminalSafe(j.reason) << "\n";
  }
  out << "\nworkers:\n";
  if (reply.workers.empty()) out << "  (none registered)\n";
  for (const WorkerSummary& w : reply.workers) {
    out << "  " << w.host << " " << w.device;
    if (!w.gpu_name.empty())
      out << " (" << w.gpu_name << ", " << FormatBytes(w.gpu_memory_bytes) << ")";
    out << "  " << FormatSlots(w) << "\n";
  }
  return out.str();
}

int RunWatch(client::Client& client, const WatchOptions& options, std::ostream& out) {
  WatchRequest req;
  req.job_ids = options.job_ids;
  req.wait_ms = options.poll_wait_ms;
  std::set<int64_t> watched(options.job_ids.begin(), options.job_ids.end());
  std::set<int64_t> seen;  // every job id present at the first reply or since
  bool first = true;
  std::map<int64_t, std::pair<JobState, double>> last_line;  // plain mode throttle
  std::map<int64_t, std::string> last_text;                  // plain mode: no repeats
  std::string last_workers;
  double unreachable_since = -1;
  TokenRateSmoother smoother;
  while (true) {
    WatchReply reply;
    try {
      reply = client.Call(req, options.poll_wait_ms + 5000);
      unreachable_since = -1;
    } catch (const Error& e) {
      // A coordinator restarting (its journal keeps every job) is worth waiting for.
      if (e.code() != ErrorCode::kTimeout) throw;
      if (unreachable_since < 0) {
        unreachable_since = Now();
        out << "coordinator unreachable; retrying for " << options.reconnect_s << " s\n"
            << std::flush;
      }
      if (Now() - unreachable_since > options.reconnect_s) throw;
      continue;
    }
    req.since_version = reply.version;
    smoother.Apply(reply);
    if (options.job_ids.empty()) {
      // All jobs: those not ended at the start, and every job that appears later.
      for (const JobSummary& j : reply.jobs) {
        if (first ? !IsTerminal(j.state) : !seen.count(j.id)) watched.insert(j.id);
        seen.insert(j.id);
      }
    }
    first = false;
    std::vector<int64_t> ids(watched.begin(), watched.end());
    bool all_done = true, all_ok = true;
    for (const JobSummary& j : reply.jobs) {
      if (!watched.count(j.id)) continue;
      all_done = all_done && IsTerminal(j.state);
      all_ok = all_ok && (!IsTerminal(j.state) || j.state == JobState::kSucceeded);
    }
    if (options.tty) {
      out << "\x1b[H\x1b[2J" << RenderFrame(reply, ids, options.width) << std::flush;
    } else {
      double now = Now();
      for (const JobSummary& j : reply.jobs) {
        if (!watched.count(j.id)) continue;
        auto it = last_line.find(j.id);
        bool changed = it == last_line.end() || it->second.first != j.state;
        bool due = it != last_line.end() && now - it->second.second >= options.line_interval_s &&
                   j.state == JobState::kRunning;
        if (changed || due) {
          // A line identical to the job's previous one says nothing new (no step since).
          std::string line = RenderLine(j);
          if (changed || line != last_text[j.id]) out << line << "\n";
          last_line[j.id] = {j.state, now};
          last_text[j.id] = std::move(line);
        }
      }
      std::ostringstream workers;
      for (const WorkerSummary& w : reply.workers)
        workers << " " << w.host << "/" << w.device
                << (w.gpu_name.empty() ? "" : "(" + w.gpu_name + ")") << " " << FormatSlots(w);
      if (workers.str() != last_workers) {
        out << "workers:" << (workers.str().empty() ? " none" : workers.str()) << "\n";
        last_workers = workers.str();
      }
      out << std::flush;
    }
    if (watched.empty()) {
      out << "no jobs to watch\n";
      return 0;
    }
    if (all_done) {
      if (options.tty)
        for (const JobSummary& j : reply.jobs)
          if (watched.count(j.id)) out << RenderLine(j) << "\n";
      return all_ok ? 0 : 1;
    }
  }
}

}  // namespace lorastream::cli
