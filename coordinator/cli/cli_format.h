// How the `lorastream` command prints what the coordinator says: human tables, JSON for
// `--json`, and CSV/JSON exports of statistics. Pure functions (tested without sockets).
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/protocol/messages.h"

namespace lorastream::cli {

nlohmann::json ToJson(const StepStats& s);
nlohmann::json ToJson(const JobSummary& job);
nlohmann::json ToJson(const WorkerSummary& worker);

std::string JobsTable(const std::vector<JobSummary>& jobs);
std::string WorkersTable(const std::vector<WorkerSummary>& workers);
// best_checkpoint: where the checkpoint with the lowest eval loss is ("" = not known).
std::string JobDetails(const ShowJobReply& reply, const std::string& best_checkpoint = "",
                       const std::string& best_adapter = "");

// One header line, then one line per step; columns named as the StepStats fields.
std::string StatsCsv(const std::vector<StepStats>& stats);
std::string StatsJson(int64_t job_id, const std::vector<StepStats>& stats);

// A worker's job slots and what runs in them: "2/4 slots: jobs 3, 5", "0/1 slot: idle".
std::string FormatSlots(const WorkerSummary& worker);

// "1:02:03", "4:05", "-" for an unknown duration.
std::string FormatDuration(double seconds);
// "step 12/100", or "step 12" when the total is unknown.
std::string FormatProgress(const JobSummary& job);

}  // namespace lorastream::cli
