// `lorastream down`: stops a cluster that `lorastream up --detach` (or --keep) left running,
// in the order `up` itself stops one: workers, coordinator, store; then removes the
// coordinator's socket file and the cluster's record.
#pragma once

#include <ostream>
#include <string>
#include <vector>

namespace lorastream::cli {

// Records that the cluster of `run_dir` runs on after `up` returned:
// DefaultRuntimeDir()/up-PID.cluster holds the run folder (the cluster's cluster.json, written
// by LocalCluster::WriteClusterFile, says what runs).
void WriteUpRecord(const std::string& run_dir);

// The run folders of the clusters recorded on this host for this user, oldest first.
std::vector<std::string> RecordedClusters();

// Stops the cluster of `run_dir` ("" = the one recorded; refused, listing them, when there
// are several; Error kNotFound when there is none). Each part gets SIGTERM and `grace_s`
// seconds to exit, then SIGKILL. A pid that is no longer a lorastream process is skipped.
// Returns the exit status (0).
int RunDown(const std::string& run_dir, double grace_s, std::ostream& out);

}  // namespace lorastream::cli
