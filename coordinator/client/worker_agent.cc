#include "coordinator/client/worker_agent.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>
#include <variant>

#include "common/base/error.h"
#include "common/base/log.h"

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

JobResult FailedResult(const std::exception_ptr& error, const JobAssignment& a) {
  JobResult result;
  result.kind = JobResult::Kind::kFailed;
  try {
    std::rethrow_exception(error);
  } catch (const Error& e) {
    // Our errors may list several problems, one per line: the coordinator gets all of them on
    // one line, which is what `jobs` and `show` can display.
    LS_LOG_ERROR("job {} attempt {} failed: {}", a.job_id, a.attempt, WithoutBacktrace(e.what()));
    result.reason = JoinLines(WithoutBacktrace(e.what()));
  } catch (const std::exception& e) {
    // Anything else (LibTorch appends a backtrace): the whole message goes to this worker's
    // log, the coordinator gets its first line.
    // LibTorch's backtrace is dropped from both; a message of several lines is one here.
    const std::string what = WithoutBacktrace(e.what());
    LS_LOG_ERROR("job {} attempt {} failed: {}", a.job_id, a.attempt, what);
    result.reason = JoinLines(what);
  } catch (...) {
    LS_LOG_ERROR("job {} attempt {} failed: an unknown exception", a.job_id, a.attempt);
    result.reason = "an unknown exception";
  }
  return result;
}

struct WorkerAgent::Impl final : JobSlots {
  // A job's flags, shared with its context's callbacks.
  struct Flags {
    std::atomic<bool> stop{false};  // cancelled or no longer ours: stop at the step boundary
    std::atomic<bool> lost{false};  // went elsewhere: nothing more is reported
  };
  struct Slot {
    std::shared_ptr<const JobContext> job;
    std::shared_ptr<Flags> flags;
    bool taken = false;  // handed to the runner
    bool ended = false;  // Finish was called; the slot frees once the end is reported
  };
  using Report = std::variant<StepReport, CheckpointReport, JobFinished>;
  struct Queued {
    uint64_t seq = 0;
    int64_t job_id = 0;
    Report report;
  };

  WorkerAgentOptions options;
  SlotRunner runner;
  Client client;  // the communication thread's alone
  std::string worker_id;
  double heartbeat_interval_s = 1.0;
  const std::atomic<bool>* stop = nullptr;

  std::mutex mu;
  std::condition_variable comm_cv;                      // wakes the communication thread
  std::condition_variable taken_cv;                     // wakes the training thread waiting in Take
  std::map<int64_t, Slot> slots;                        // under mu: job id -> its slot
  std::deque<std::shared_ptr<const JobContext>> fresh;  // under mu: assigned, not taken
  std::deque<Queued> queue;                             // under mu: reports to send
  uint64_t next_seq = 1;                                // under mu
  bool training_done = false;                           // under mu
  bool ask_now = false;  // under mu: a slot was freed: ask for work at once
  int jobs_ended = 0;    // under mu

  Impl(WorkerAgentOptions o, SlotRunner r)
      : options(WithWorkerKey(std::move(o))), runner(std::move(r)), client(options.client) {
    if (options.host.empty()) options.host = HostName();
    if (options.slots < 1)
      throw Error(ErrorCode::kInvalidArgument, "a worker has at least one job slot (found " +
                                                   std::to_string(options.slots) + ")");
  }

  bool stopping() const { return stop->load(); }

  // One request; nullopt when the coordinator did not answer in time. Refusals throw.
  template <class Request>
  std::optional<typename MessageTraits<Request>::Reply> Try(const Request& request) {
    try {
      return client.Call(request);
    } catch (const Error& e) {
      if (e.code() == ErrorCode::kTimeout) return std::nullopt;
      throw;
    }
  }

  std::vector<RunningJob> Running() {
    std::lock_guard<std::mutex> lock(mu);
    std::vector<RunningJob> out;
    for (const auto& [id, slot] : slots) out.push_back({id, slot.job->assignment.attempt});
    return out;
  }

  // Forgets what is queued of a job that is no longer ours, and its slot once it has ended.
  void DropLocked(int64_t job_id) {
    auto it = slots.find(job_id);
    if (it != slots.end()) {
      it->second.flags->lost = true;
      it->second.flags->stop = true;
      if (it->second.ended) FreeLocked(it);
    }
    queue.erase(std::remove_if(queue.begin(), queue.end(),
                               [&](const Queued& q) { return q.job_id == job_id; }),
                queue.end());
  }

  void FreeLocked(std::map<int64_t, Slot>::iterator it) {
    slots.erase(it);
    ask_now = true;
    comm_cv.notify_all();
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
    req.running = Running();
    req.slots = options.slots;
    req.uid = static_cast<int64_t>(::geteuid());
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
    size_t kept = 0;
    {
      std::lock_guard<std::mutex> lock(mu);
      for (const RunningJob& r : req.running) {
        const auto& k = reply->kept_jobs;
        if (std::find(k.begin(), k.end(), r.job_id) != k.end()) {
          ++kept;
          continue;
        }
        LS_LOG_WARN("job {} now belongs elsewhere: stopping it", r.job_id);
        DropLocked(r.job_id);
      }
    }
    LS_LOG_INFO("registered with {} as {} ({} job slot{}){}", client.endpoint(), worker_id,
                options.slots, options.slots == 1 ? "" : "s",
                kept > 0
                    ? " keeping " + std::to_string(kept) + " running job" + (kept == 1 ? "" : "s")
                    : "");
    return true;
  }

  // A job the coordinator assigned: into a slot, for the runner to take.
  void Accept(const JobAssignment& a) {
    std::lock_guard<std::mutex> lock(mu);
    if (slots.count(a.job_id) != 0) return;  // the same assignment again (a reply was lost)
    auto flags = std::make_shared<Flags>();
    auto job = std::make_shared<JobContext>();
    job->assignment = a;
    const int64_t id = a.job_id;
    const int32_t attempt = a.attempt;
    job->report_step = [this, flags, id, attempt](const StepStats& s) {
      if (!flags->lost) Enqueue(id, StepReport{"", id, attempt, s});
    };
    job->report_checkpoint = [this, flags, id, attempt](int64_t step, const std::string& path) {
      if (!flags->lost) Enqueue(id, CheckpointReport{"", id, attempt, step, path});
    };
    job->should_stop = [this, flags] { return flags->stop.load() || stopping(); };
    slots[id] = Slot{job, flags};
    fresh.push_back(job);
    taken_cv.notify_all();
    LS_LOG_INFO("job {} '{}' attempt {}: starting in slot {}/{} (resume from step {})", id,
                a.spec.name, attempt, slots.size(), options.slots, a.resume_step);
  }

  // One heartbeat naming every job of the slots; nullopt when unanswered. Re-registers when
  // the coordinator forgot us.
  std::optional<HeartbeatReply> Heartbeat() {
    HeartbeatRequest req;
    req.worker_id = worker_id;
    req.running = Running();
    req.free_slots = stopping() ? 0 : options.slots - static_cast<int32_t>(req.running.size());
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
    if (!reply) return reply;
    std::lock_guard<std::mutex> lock(mu);
    for (int64_t id : reply->stop_jobs) {
      auto it = slots.find(id);
      if (it != slots.end()) it->second.flags->stop = true;
    }
    return reply;
  }

  // Sends the queued reports in order; false when the coordinator did not answer (the report
  // stays queued).
  bool SendQueued() {
    while (true) {
      Queued item;
      {
        std::lock_guard<std::mutex> lock(mu);
        if (queue.empty()) return true;
        item = queue.front();
      }
      std::optional<WorkerAck> ack;
      try {
        // The id is filled in here, on the only thread that may re-register meanwhile.
        ack = std::visit(
            [&](auto report) {
              report.worker_id = worker_id;
              return Try(report);
            },
            item.report);
      } catch (const Error& e) {
        if (e.code() == ErrorCode::kNotFound) {
          // The coordinator restarted and forgot us: register again, naming the jobs; the
          // reports of those it keeps are sent on the next round.
          LS_LOG_WARN("{}: registering again", e.what());
          if (!Register()) return false;
          continue;
        }
        std::lock_guard<std::mutex> lock(mu);
        if (std::holds_alternative<JobFinished>(item.report)) {
          LS_LOG_WARN("end of job {} refused: {}", item.job_id, e.what());
          auto it = slots.find(item.job_id);
          if (it != slots.end()) FreeLocked(it);
        } else {
          // Refused: this worker no longer owns the job. Nothing more to report.
          LS_LOG_WARN("report refused ({}): stopping job {}", e.what(), item.job_id);
        }
        DropLocked(item.job_id);
        continue;
      }
      if (!ack) return false;
      std::lock_guard<std::mutex> lock(mu);
      auto it = slots.find(item.job_id);
      if (std::holds_alternative<JobFinished>(item.report)) {
        if (it != slots.end()) FreeLocked(it);
      } else if (ack->stop_job && it != slots.end()) {
        it->second.flags->stop = true;
      }
      if (!queue.empty() && queue.front().seq == item.seq) queue.pop_front();
    }
  }

  void Enqueue(int64_t job_id, Report report) {
    std::lock_guard<std::mutex> lock(mu);
    if (queue.size() >= options.max_queued_reports) {
      // The oldest step report goes; checkpoints and ends are never dropped.
      auto it = std::find_if(queue.begin(), queue.end(), [](const Queued& q) {
        return std::holds_alternative<StepReport>(q.report);
      });
      if (it != queue.end()) queue.erase(it);
    }
    queue.push_back(Queued{next_seq++, job_id, std::move(report)});
    comm_cv.notify_all();
  }

  // Waits until `until`, a report to send, a freed slot or the end, checking `stop` as it goes.
  void Wait(Clock::time_point until, bool reports_wake) {
    std::unique_lock<std::mutex> lock(mu);
    while (Clock::now() < until && !(training_done && stopping()) &&
           !(reports_wake && !queue.empty()) && !ask_now)
      comm_cv.wait_until(lock, std::min(until, Clock::now() + std::chrono::milliseconds(50)));
  }

  std::chrono::steady_clock::duration Seconds(double s) {
    return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
  }

  // The communication thread: registration, reports as they come, heartbeats on the interval
  // and at once while a slot is free after a job was taken or a slot freed.
  void CommLoop() {
    auto next_heartbeat = Clock::now();
    int unanswered_in_stop = 0;
    while (true) {
      {
        std::lock_guard<std::mutex> lock(mu);
        // Stopping: flush the reports, retrying a few times while the coordinator is away.
        if (training_done && stopping() && (queue.empty() || unanswered_in_stop >= 3)) return;
        if (ask_now) {
          next_heartbeat = Clock::now();
          ask_now = false;
        }
      }
      if (worker_id.empty()) {
        if (!Register()) {
          if (stopping()) ++unanswered_in_stop;
          Wait(Clock::now() + Seconds(options.retry_interval_s), false);
        }
        continue;
      }
      const bool reachable = SendQueued();
      if (!reachable && stopping()) ++unanswered_in_stop;
      if (Clock::now() >= next_heartbeat) {
        std::optional<HeartbeatReply> reply = Heartbeat();
        next_heartbeat =
            Clock::now() + Seconds(reply ? heartbeat_interval_s : options.retry_interval_s);
        if (reply && reply->has_assignment && !stopping()) {
          Accept(reply->assignment);
          std::lock_guard<std::mutex> lock(mu);
          if (static_cast<int>(slots.size()) < options.slots) next_heartbeat = Clock::now();
        }
      }
      const auto retry = Clock::now() + Seconds(options.retry_interval_s);
      Wait(reachable ? next_heartbeat : std::min(next_heartbeat, retry), reachable);
    }
  }

  std::vector<std::shared_ptr<const JobContext>> Take(bool wait) override {
    std::unique_lock<std::mutex> lock(mu);
    while (wait && fresh.empty() && !stopping())
      taken_cv.wait_for(lock, std::chrono::milliseconds(50));
    std::vector<std::shared_ptr<const JobContext>> out;
    if (stopping()) return out;  // what is still fresh ends in Run, never started
    for (const auto& job : fresh) {
      slots.at(job->assignment.job_id).taken = true;
      out.push_back(job);
    }
    fresh.clear();
    return out;
  }

  void Finish(const JobContext& job, const JobResult& result) override {
    const JobAssignment& a = job.assignment;
    std::lock_guard<std::mutex> lock(mu);
    auto it = slots.find(a.job_id);
    if (it == slots.end() || it->second.ended) return;
    Slot& slot = it->second;
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
        done.outcome = slot.flags->stop.load() ? JobOutcome::kCancelled : JobOutcome::kInterrupted;
        break;
    }
    LS_LOG_INFO("job {} attempt {}: {} at step {}{}", a.job_id, a.attempt,
                result.kind == JobResult::Kind::kCompleted ? "completed"
                : result.kind == JobResult::Kind::kStopped ? "stopped"
                                                           : "failed",
                result.final_step, result.reason.empty() ? "" : ": " + result.reason);
    ++jobs_ended;
    slot.ended = true;
    if (slot.flags->lost) {
      FreeLocked(it);
      return;
    }
    // After the job's statistics, in order; retried while the coordinator is away (a restart
    // must not lose a finished job).
    queue.push_back(Queued{next_seq++, a.job_id, done});
    comm_cv.notify_all();
  }

  // Ends the jobs that were assigned but never run, or that the runner left unfinished.
  void FinishLeftovers(const std::exception_ptr& error) {
    std::vector<std::shared_ptr<const JobContext>> left;
    {
      std::lock_guard<std::mutex> lock(mu);
      for (const auto& [id, slot] : slots)
        if (!slot.ended && (error ? slot.taken : !slot.taken)) left.push_back(slot.job);
      if (!error) fresh.clear();
    }
    for (const auto& job : left) {
      JobResult result;
      if (error) {
        result = FailedResult(error, job->assignment);
      } else {
        result.kind = JobResult::Kind::kStopped;  // never started: interrupted, requeued
        result.final_step = job->assignment.resume_step;
      }
      Finish(*job, result);
    }
  }
};

WorkerAgent::WorkerAgent(WorkerAgentOptions options, SlotRunner runner)
    : impl_(std::make_unique<Impl>(std::move(options), std::move(runner))) {}

WorkerAgent::~WorkerAgent() = default;

int WorkerAgent::Run(const std::atomic<bool>& stop) {
  Impl& s = *impl_;
  s.stop = &stop;
  std::thread comm([&s] { s.CommLoop(); });
  while (true) {
    try {
      s.runner(s);
    } catch (...) {
      const std::exception_ptr error = std::current_exception();
      s.FinishLeftovers(error);
    }
    if (stop.load()) break;
  }
  s.FinishLeftovers(nullptr);
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.training_done = true;
    s.comm_cv.notify_all();
  }
  comm.join();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.jobs_ended;
}

}  // namespace lorastream::client
