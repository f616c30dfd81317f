#include "coordinator/worker_agent.h"

#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>
#include <variant>

#include "common/error.h"
#include "common/log.h"

namespace lorastream::client {
namespace {

using Clock = std::chrono::steady_clock;

std::string HostName() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "localhost";
  return buf;
}

// "job refused:\n  problem 1\n  problem 2" -> "job refused: problem 1; problem 2".
std::string JoinLines(const std::string& text) {
  std::string out;
  size_t start = 0;
  while (start <= text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    size_t first = text.find_first_not_of(" \t\r", start);
    if (first < end) {
      std::string line = text.substr(first, end - first);
      if (!out.empty()) out += out.back() == ':' ? " " : "; ";
      out += line;
    }
    start = end + 1;
  }
  return out;
}

// Under CURVE a worker presents the worker key pair of the keys folder (worker.*).
WorkerAgentOptions WithWorkerKey(WorkerAgentOptions options) {
  options.client.key_role = "worker";
  return options;
}

}  // namespace

struct WorkerAgent::Impl {
  WorkerAgentOptions options;
  JobRunner runner;
  std::mutex rpc_mu;  // one request at a time on the client
  Client client;
  std::string worker_id;
  double heartbeat_interval_s = 1.0;

  // The running job (job_id 0: idle) and its flags.
  std::atomic<int64_t> job_id{0};
  int32_t attempt = 0;
  std::atomic<bool> stop_job{false};  // cancel or lost: stop at the next step boundary
  std::atomic<bool> lost_job{false};  // the job went elsewhere: do not report its end

  std::mutex queue_mu;
  std::condition_variable queue_cv;
  std::deque<std::variant<StepReport, CheckpointReport>> queue;
  bool job_done = false;

  Impl(WorkerAgentOptions o, JobRunner r)
      : options(WithWorkerKey(std::move(o))), runner(std::move(r)), client(options.client) {
    if (options.host.empty()) options.host = HostName();
  }

  // One request; nullopt when the coordinator did not answer in time. Refusals throw.
  template <class Request>
  std::optional<typename MessageTraits<Request>::Reply> Try(const Request& request) {
    std::lock_guard<std::mutex> lock(rpc_mu);
    try {
      return client.Call(request);
    } catch (const Error& e) {
      if (e.code() == ErrorCode::kTimeout) return std::nullopt;
      throw;
    }
  }

  bool Register() {
    RegisterRequest req;
    req.host = options.host;
    req.device = options.device;
    req.gpu_name = options.gpu_name;
    req.gpu_memory_bytes = options.gpu_memory_bytes;
    req.pid = static_cast<int32_t>(getpid());
    req.stores = options.stores;
    req.previous_worker_id = worker_id;
    req.running_job_id = job_id.load();
    req.running_attempt = attempt;
    std::optional<RegisterReply> reply;
    try {
      reply = Try(req);
    } catch (const Error& e) {
      LS_LOG_ERROR("registration refused: {}", e.what());
      return false;
    }
    if (!reply) return false;
    worker_id = reply->worker_id;
    heartbeat_interval_s = reply->heartbeat_interval_s > 0 ? reply->heartbeat_interval_s : 1.0;
    if (job_id.load() != 0 && !reply->keep_running_job) {
      LS_LOG_WARN("job {} now belongs elsewhere: stopping it", job_id.load());
      lost_job = true;
      stop_job = true;
    }
    LS_LOG_INFO("registered with {} as {}{}", client.endpoint(), worker_id,
                job_id.load() != 0 && reply->keep_running_job ? " (keeping the running job)" : "");
    return true;
  }

  // One heartbeat; nullopt when unanswered. Re-registers when the coordinator forgot us.
  std::optional<HeartbeatReply> Heartbeat() {
    HeartbeatRequest req{worker_id, job_id.load(), attempt};
    std::optional<HeartbeatReply> reply;
    try {
      reply = Try(req);
    } catch (const Error& e) {
      LS_LOG_WARN("heartbeat refused: {}", e.what());
      return std::nullopt;
    }
    if (reply && !reply->known_worker) {
      LS_LOG_WARN("the coordinator does not know this worker (restarted?): registering again");
      Register();
      return std::nullopt;
    }
    if (reply && reply->stop_job && job_id.load() != 0) stop_job = true;
    return reply;
  }

  // Sends the queued reports in order; false when the coordinator did not answer (the
  // report stays queued).
  bool SendQueued() {
    while (true) {
      std::variant<StepReport, CheckpointReport> item;
      {
        std::lock_guard<std::mutex> lock(queue_mu);
        if (queue.empty()) return true;
        item = queue.front();
      }
      try {
        // The id is filled in here, on the only thread that may re-register meanwhile.
        std::optional<WorkerAck> ack = std::visit(
            [&](auto report) {
              report.worker_id = worker_id;
              return Try(report);
            },
            item);
        if (!ack) return false;
        if (ack->stop_job) stop_job = true;
      } catch (const Error& e) {
        if (e.code() == ErrorCode::kNotFound) {
          // The coordinator restarted and forgot us: register again, naming the job; if it
          // agrees the job is still ours, the report is sent on the next round.
          LS_LOG_WARN("{}: registering again", e.what());
          if (!Register() || !lost_job.load()) return false;
          std::lock_guard<std::mutex> lock(queue_mu);
          queue.clear();
          return true;
        }
        // Refused: this worker no longer owns the job. Nothing more to report.
        LS_LOG_WARN("report refused ({}): stopping job {}", e.what(), job_id.load());
        lost_job = true;
        stop_job = true;
        std::lock_guard<std::mutex> lock(queue_mu);
        queue.clear();
        return true;
      }
      std::lock_guard<std::mutex> lock(queue_mu);
      if (!queue.empty()) queue.pop_front();
    }
  }

  template <class Report>
  void Enqueue(Report report) {
    std::lock_guard<std::mutex> lock(queue_mu);
    if (queue.size() >= options.max_queued_reports) queue.pop_front();
    queue.emplace_back(std::move(report));
    queue_cv.notify_one();
  }

  // The job-time thread: reports as they come, heartbeats on the interval.
  void CommLoop() {
    auto next_heartbeat = Clock::now();
    while (true) {
      {
        std::unique_lock<std::mutex> lock(queue_mu);
        queue_cv.wait_until(lock, next_heartbeat, [&] { return job_done || !queue.empty(); });
        if (job_done) return;
      }
      if (!SendQueued()) {
        // Unreachable: wait before retrying, but keep heartbeating (which re-registers).
        std::unique_lock<std::mutex> lock(queue_mu);
        queue_cv.wait_for(lock, std::chrono::duration<double>(options.retry_interval_s),
                          [&] { return job_done; });
      }
      if (Clock::now() >= next_heartbeat) {
        Heartbeat();
        next_heartbeat = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                            std::chrono::duration<double>(heartbeat_interval_s));
      }
    }
  }

  void Sleep(double seconds, const std::atomic<bool>& stop) {
    auto until = Clock::now() + std::chrono::duration<double>(seconds);
    while (!stop.load() && Clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }

  void RunJob(const JobAssignment& a, const std::atomic<bool>& stop) {
    job_id = a.job_id;
    attempt = a.attempt;
    stop_job = false;
    lost_job = false;
    {
      std::lock_guard<std::mutex> lock(queue_mu);
      queue.clear();
      job_done = false;
    }
    LS_LOG_INFO("job {} '{}' attempt {}: starting (resume from step {})", a.job_id, a.spec.name,
                a.attempt, a.resume_step);
    std::thread comm([this] { CommLoop(); });
    JobContext ctx{a,
                   [this, &a](const StepStats& s) {
                     Enqueue(StepReport{"", a.job_id, a.attempt, s});
                   },
                   [this, &a](int64_t step, const std::string& path) {
                     Enqueue(CheckpointReport{"", a.job_id, a.attempt, step, path});
                   },
                   [this, &stop] { return stop_job.load() || stop.load(); }};
    JobResult result;
    try {
      result = runner(ctx);
    } catch (const Error& e) {
      // Our errors may list several problems, one per line: the coordinator gets all of them
      // on one line, which is what `jobs` and `show` can display.
      LS_LOG_ERROR("job {} attempt {} failed: {}", a.job_id, a.attempt, e.what());
      result.kind = JobResult::Kind::kFailed;
      result.reason = JoinLines(e.what());
    } catch (const std::exception& e) {
      // Anything else (LibTorch appends a backtrace): the whole message goes to this worker's
      // log, the coordinator gets its first line.
      std::string what = e.what();
      LS_LOG_ERROR("job {} attempt {} failed: {}", a.job_id, a.attempt, what);
      result.kind = JobResult::Kind::kFailed;
      result.reason = what.substr(0, what.find('\n'));
    }
    {
      std::lock_guard<std::mutex> lock(queue_mu);
      job_done = true;
      queue_cv.notify_all();
    }
    comm.join();

    JobFinished done;
    done.job_id = a.job_id;
    done.attempt = a.attempt;
    done.reason = result.reason;
    done.adapter_path = result.adapter_path;
    done.final_step = result.final_step;
    switch (result.kind) {
      case JobResult::Kind::kCompleted:
        done.outcome = JobOutcome::kSucceeded;
        break;
      case JobResult::Kind::kFailed:
        done.outcome = JobOutcome::kFailed;
        break;
      case JobResult::Kind::kStopped:
        done.outcome = stop_job.load() ? JobOutcome::kCancelled : JobOutcome::kInterrupted;
        break;
    }
    LS_LOG_INFO("job {} attempt {}: {} at step {}{}", a.job_id, a.attempt,
                result.kind == JobResult::Kind::kCompleted ? "completed"
                : result.kind == JobResult::Kind::kStopped ? "stopped"
                                                           : "failed",
                result.final_step, result.reason.empty() ? "" : ": " + result.reason);
    // Flush the statistics, then the end; retry while the coordinator is away (a restart
    // must not lose a finished job), unless this worker is shutting down.
    for (int tries = 0; !lost_job.load(); ++tries) {
      done.worker_id = worker_id;
      bool sent = false;
      try {
        if (SendQueued() && !lost_job.load()) sent = Try(done).has_value();
      } catch (const Error& e) {
        LS_LOG_WARN("end of job {} refused: {}", a.job_id, e.what());
        break;
      }
      if (sent || (stop.load() && tries >= 3)) break;
      Sleep(options.retry_interval_s, stop);
      Heartbeat();  // re-registers (keeping the job) after a coordinator restart
    }
    job_id = 0;
    attempt = 0;
  }
};

WorkerAgent::WorkerAgent(WorkerAgentOptions options, JobRunner runner)
    : impl_(std::make_unique<Impl>(std::move(options), std::move(runner))) {}

WorkerAgent::~WorkerAgent() = default;

int WorkerAgent::Run(const std::atomic<bool>& stop) {
  Impl& s = *impl_;
  int jobs = 0;
  while (!stop.load()) {
    if (s.worker_id.empty()) {
      if (!s.Register()) s.Sleep(s.options.retry_interval_s, stop);
      continue;
    }
    std::optional<HeartbeatReply> reply = s.Heartbeat();
    if (!reply) {
      s.Sleep(s.options.retry_interval_s, stop);
      continue;
    }
    if (reply->has_assignment) {
      s.RunJob(reply->assignment, stop);
      ++jobs;
      continue;  // ask for the next job at once
    }
    s.Sleep(s.heartbeat_interval_s, stop);
  }
  return jobs;
}

}  // namespace lorastream::client
