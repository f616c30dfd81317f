#include "coordinator/cli/cli_format.h"

#include <cmath>
#include <cstdio>
#include <sstream>

#include "common/base/format_bytes.h"
#include "common/base/terminal_text.h"
#include "common/job/step_stats_json.h"

namespace lorastream::cli {
namespace {

// "3,5" for `separator` ",".
std::string JobList(const std::vector<int64_t>& ids, const std::string& separator) {
  std::string out;
  for (int64_t id : ids) out += (out.empty() ? "" : separator) + std::to_string(id);
  return out;
}

std::string Printf(const char* fmt, double value) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), fmt, value);
  return buf;
}

// A column of plain text (numbers, states): padded to `width`.
std::string Pad(std::string s, size_t width) {
  if (s.size() < width) s.append(width - s.size(), ' ');
  return s;
}

}  // namespace

std::string FormatDuration(double seconds) {
  if (!(seconds >= 0) || !std::isfinite(seconds)) return "-";
  long total = std::lround(seconds);
  char buf[32];
  if (total >= 3600)
    std::snprintf(buf, sizeof(buf), "%ld:%02ld:%02ld", total / 3600, (total / 60) % 60, total % 60);
  else
    std::snprintf(buf, sizeof(buf), "%ld:%02ld", total / 60, total % 60);
  return buf;
}

std::string FormatProgress(const JobSummary& job) {
  std::string s = "step " + std::to_string(job.step);
  if (job.total_steps > 0) s += "/" + std::to_string(job.total_steps);
  return s;
}

nlohmann::json ToJson(const StepStats& s) { return StepStatsToJson(s); }

nlohmann::json ToJson(const JobSummary& j) {
  nlohmann::json out = {{"id", j.id},
                        {"name", j.name},
                        {"state", JobStateName(j.state)},
                        {"reason", j.reason},
                        {"priority", j.priority},
                        {"store", j.store_name},
                        {"fingerprint", j.fingerprint},
                        {"spec_source", j.spec_source},
                        {"output_dir", j.output_dir},
                        {"submitter", j.submitter},
                        {"submitter_uid", j.submitter_uid},
                        {"adapter_path", j.adapter_path},
                        {"worker_id", j.worker_id},
                        {"worker_host", j.worker_host},
                        {"worker_device", j.worker_device},
                        {"attempt", j.attempt},
                        {"step", j.step},
                        {"total_steps", j.total_steps},
                        {"checkpoint_step", j.checkpoint_step},
                        {"checkpoint_path", j.checkpoint_path},
                        {"cancel_requested", j.cancel_requested},
                        {"submitted_at", j.submitted_at},
                        {"started_at", j.started_at},
                        {"finished_at", j.finished_at},
                        {"eta_seconds", j.eta_seconds}};
  out["last_stats"] = j.has_stats ? ToJson(j.last_stats) : nlohmann::json(nullptr);
  const bool evaluated = j.last_eval_step > 0;
  out["last_eval_step"] = evaluated ? nlohmann::json(j.last_eval_step) : nlohmann::json(nullptr);
  out["last_eval_loss"] = evaluated ? nlohmann::json(j.last_eval_loss) : nlohmann::json(nullptr);
  out["best_eval_step"] = evaluated ? nlohmann::json(j.best_eval_step) : nlohmann::json(nullptr);
  out["best_eval_loss"] = evaluated ? nlohmann::json(j.best_eval_loss) : nlohmann::json(nullptr);
  return out;
}

nlohmann::json ToJson(const WorkerSummary& w) {
  nlohmann::json stores = nlohmann::json::array();
  for (const StoreInfo& s : w.stores)
    stores.push_back({{"name", s.name}, {"fingerprint", s.fingerprint}});
  return {{"id", w.id},
          {"host", w.host},
          {"device", w.device},
          {"gpu_name", w.gpu_name},
          {"gpu_memory_bytes", w.gpu_memory_bytes},
          {"pid", w.pid},
          {"stores", stores},
          {"alive", w.alive},
          {"slots", w.slots},
          {"job_ids", w.job_ids},
          {"seconds_since_heartbeat", w.seconds_since_heartbeat}};
}

std::string JobsTable(const std::vector<JobSummary>& jobs) {
  std::ostringstream out;
  out << Pad("ID", 6) << Pad("NAME", 20) << Pad("STATE", 11) << Pad("PRI", 5) << Pad("PROGRESS", 18)
      << Pad("WORKER", 26) << "REASON\n";
  for (const JobSummary& j : jobs) {
    std::string where = j.worker_id.empty() ? "-" : j.worker_host + " " + j.worker_device;
    out << Pad(std::to_string(j.id), 6) << TerminalColumn(j.name, 20)
        << Pad(JobStateName(j.state), 11) << Pad(std::to_string(j.priority), 5)
        << Pad(FormatProgress(j), 18) << TerminalColumn(where, 26) << TerminalSafe(j.reason)
        << "\n";
  }
  return out.str();
}

std::string FormatSlots(const WorkerSummary& w) {
  return std::to_string(w.job_ids.size()) + "/" + std::to_string(w.slots) +
         (w.slots == 1 ? " slot: " : " slots: ") +
         (w.job_ids.empty()
              ? std::string("idle")
              : (w.job_ids.size() == 1 ? "job " : "jobs ") + JobList(w.job_ids, ", "));
}

std::string WorkersTable(const std::vector<WorkerSummary>& workers) {
  std::ostringstream out;
  out << Pad("ID", 27) << Pad("HOST", 16) << Pad("DEVICE", 9) << Pad("GPU", 28) << Pad("STATE", 7)
      << Pad("SLOTS", 7) << Pad("JOBS", 12) << "STORES\n";
  for (const WorkerSummary& w : workers) {
    std::string gpu = w.gpu_name.empty() ? "-" : w.gpu_name + " " + FormatBytes(w.gpu_memory_bytes);
    std::string stores;
    for (const StoreInfo& s : w.stores) stores += (stores.empty() ? "" : ",") + s.name;
    out << TerminalColumn(w.id, 27) << TerminalColumn(w.host, 16) << TerminalColumn(w.device, 9)
        << TerminalColumn(gpu, 28)
        << Pad(w.alive ? (w.job_ids.empty() ? "idle" : "busy") : "dead", 7)
        << Pad(std::to_string(w.job_ids.size()) + "/" + std::to_string(w.slots), 7)
        << Pad(w.job_ids.empty() ? "-" : JobList(w.job_ids, ","), 12)
        << (stores.empty() ? "-" : TerminalSafe(stores)) << "\n";
  }
  return out.str();
}

std::string JobDetails(const ShowJobReply& r, const std::string& best_checkpoint,
                       const std::string& best_adapter) {
  const JobSummary& j = r.job;
  const auto safe = [](const std::string& text) { return TerminalSafe(text); };
  std::ostringstream out;
  out << "job " << j.id << " '" << safe(j.name) << "': " << JobStateName(j.state);
  if (!j.reason.empty()) out << " (" << safe(j.reason) << ")";
  out << "\n  progress:    " << FormatProgress(j) << ", ETA " << FormatDuration(j.eta_seconds)
      << "\n  priority:    " << j.priority << "\n  submitter:   "
      << (j.submitter_uid < 0
              ? "-"
              : safe(j.submitter) + " (uid " + std::to_string(j.submitter_uid) + ")")
      << "\n  base model:  "
      << (j.store_name.empty() ? "(checkpoint folder)" : "store " + safe(j.store_name))
      << (j.fingerprint.empty() ? "" : " [" + safe(j.fingerprint) + "]") << "\n  worker:      "
      << (j.worker_id.empty() ? "-"
                              : safe(j.worker_id + " on " + j.worker_host + " " + j.worker_device))
      << "\n  attempt:     " << j.attempt << " (" << r.retries << " retries after worker deaths)"
      << "\n  checkpoint:  "
      << (j.checkpoint_step
              ? "step " + std::to_string(j.checkpoint_step) + " in " + safe(j.checkpoint_path)
              : "-")
      << "\n  output:      " << safe(j.output_dir)
      << "\n  adapter:     " << (j.adapter_path.empty() ? "-" : safe(j.adapter_path));
  if (j.last_eval_step > 0)
    out << "\n  eval loss:   " << Printf("%.4f", j.last_eval_loss) << " at step "
        << j.last_eval_step << " (lowest " << Printf("%.4f", j.best_eval_loss) << " at step "
        << j.best_eval_step << ")";
  if (!best_checkpoint.empty()) out << "\n  best:        " << safe(best_checkpoint);
  if (!best_adapter.empty()) out << "\n  best adapter: " << safe(best_adapter);
  out << "\n  job file:    " << safe(j.spec_source) << "\n";
  if (j.has_stats) {
    const StepStats& s = j.last_stats;
    out << "  last step:   loss " << Printf("%.4f", s.loss) << ", "
        << Printf("%.0f", s.tokens_per_second) << " tokens/s, step "
        << Printf("%.3f", s.step_seconds) << " s\n";
  }
  out << "--- job file ---\n" << TerminalSafe(r.spec_toml, /*keep_newlines=*/true);
  if (!r.spec_toml.empty() && r.spec_toml.back() != '\n') out << "\n";
  return out.str();
}

std::string StatsCsv(const std::vector<StepStats>& stats) {
  std::ostringstream out;
  out << "step,total_steps,loss,learning_rate,grad_norm,tokens,step_seconds,tokens_per_second,"
         "h2d_bytes,h2d_busy_seconds,stall_seconds,copies,copies_saved,peak_device_bytes,"
         "eval_loss,eval_tokens\n";
  out.precision(9);
  for (const StepStats& s : stats) {
    out << s.step << ',' << s.total_steps << ',' << s.loss << ',' << s.learning_rate << ','
        << s.grad_norm << ',' << s.tokens << ',' << s.step_seconds << ',' << s.tokens_per_second
        << ',' << s.h2d_bytes << ',' << s.h2d_busy_seconds << ',' << s.stall_seconds << ','
        << s.copies << ',' << s.copies_saved << ',' << s.peak_device_bytes << ',';
    // Empty cells on the steps without an evaluation.
    if (s.has_eval())
      out << s.eval_loss << ',' << s.eval_tokens;
    else
      out << ',';
    out << '\n';
  }
  return out.str();
}

std::string StatsJson(int64_t job_id, const std::vector<StepStats>& stats) {
  nlohmann::json rows = nlohmann::json::array();
  for (const StepStats& s : stats) rows.push_back(ToJson(s));
  return nlohmann::json{{"job_id", job_id}, {"stats", rows}}.dump(2) + "\n";
}

}  // namespace lorastream::cli
