// `lorastream doctor`: what this machine and this build can do, each problem with its fix.
// Torch-free: the one GPU test (read-only host registration) runs in `lorastream-worker
// probe-host-register`, a child process, on CUDA builds only.
#pragma once

#include <ostream>
#include <string>

#include <nlohmann/json.hpp>

namespace lorastream::cli {

struct DoctorOptions {
  std::string endpoint;    // the coordinator to try
  std::string curve_keys;  // its CURVE keys folder ("" = none)
  double timeout_s = 2;    // for the coordinator's reply and the probe
  std::string bin_dir;     // where lorastream-worker is; "" = beside this executable
  // No coordinator answering is a problem (exit 1) only when one is expected (the user named
  // its endpoint); otherwise a note, under "notes".
  bool expect_coordinator = true;
};

// Every check as JSON: build, gpus, memlock, dev_shm, shmem_huge_pages, host_register,
// stores, coordinator, problems: [{check, problem, fix}] and notes: [{check, note, hint}]
// (what is not wrong but worth knowing: no coordinator running when none was named).
nlohmann::json DoctorReport(const DoctorOptions& options);

// The report on one screen.
std::string DoctorText(const nlohmann::json& report);

// Prints the report (JSON or text); returns 0 when it lists no problem, 1 otherwise.
int RunDoctor(const DoctorOptions& options, bool json, std::ostream& out);

}  // namespace lorastream::cli
