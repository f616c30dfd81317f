// `lorastream watch`: a live view of jobs and workers fed by long-polling Watch requests.
// On a terminal it redraws one frame (a progress bar per job with step/total and ETA, loss,
// tokens/s, stall %, H2D GB/s, then the workers and their GPUs); otherwise (a pipe, a log
// file, CI) it prints one plain line per change, throttled per job. Either way it returns
// when every watched job has ended.
#pragma once

#include <cstdint>
#include <map>
#include <ostream>
#include <vector>

#include "common/protocol/messages.h"
#include "coordinator/client/client.h"

namespace lorastream::cli {

struct WatchOptions {
  std::vector<int64_t> job_ids;  // empty: every job not yet ended (and those submitted later)
  bool tty = false;              // redraw frames instead of printing lines
  int width = 100;               // terminal columns
  double line_interval_s = 1.0;  // plain mode: at most one progress line per job this often
  int poll_wait_ms = 1000;       // long-poll wait per request
  double reconnect_s = 60;       // keep retrying this long while the coordinator is away
};

// tokens/s as `watch` shows it: per job, an exponential moving average over the steps the view
// sees (each new step weighs kWeight; the first step of an attempt, which carries its
// start-up, is replaced by the next), so that the figure does not jump with each step. The
// raw per-step figures stay in `lorastream stats`.
class TokenRateSmoother {
 public:
  static constexpr double kWeight = 0.2;
  // Rewrites each job's last_stats.tokens_per_second in `reply` with its average.
  void Apply(WatchReply& reply);

 private:
  struct State {
    int64_t step = -1;
    int32_t attempt = 0;
    double tokens_per_second = 0;
    int samples = 0;
  };
  std::map<int64_t, State> jobs_;
};

// Returns the exit status: 0 when every watched job succeeded, 1 when one failed or was
// cancelled. Throws Error (kNotFound for an unknown job, kTimeout when the coordinator is
// unreachable).
int RunWatch(client::Client& client, const WatchOptions& options, std::ostream& out);

// One terminal frame (exposed for tests).
std::string RenderFrame(const WatchReply& reply, const std::vector<int64_t>& watched, int width);
// One plain line for a job.
std::string RenderLine(const JobSummary& job);

}  // namespace lorastream::cli
