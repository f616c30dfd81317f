// A whole lorastream cluster on this host, as real processes: one store, one coordinator and
// one worker per device. `lorastream up` runs one for the user; the end-to-end tests run one
// and kill its parts. Torch-free: it only starts executables and speaks their command lines.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/job/job_kind.h"
#include "common/posix/subprocess.h"

namespace lorastream::cli {

struct LocalClusterOptions {
  std::string bin_dir;  // where lorastream, lorastream-store, -worker, -synth live
  std::string run_dir;  // logs/, model/, jobs/, adapters/, journal.db (created)
  // A Hugging Face checkpoint, a FLUX.1 one (BFL's single file or a diffusers folder) or a
  // Qwen-Image one (ComfyUI's single file or a diffusers folder); "" = synthesize `preset` (a
  // FLUX or Qwen-Image preset's single file is served).
  std::string model_dir;
  std::string preset = "tiny";  // configs/models/<preset>.toml, for a synthesized model
  std::string store_name;       // "" = "up-<pid>"
  // One worker per entry ("cuda:0", "cpu"); empty = one per visible GPU, else `cpu_workers`.
  std::vector<std::string> devices;
  int cpu_workers = 2;
  int jobs_per_worker = 0;           // each worker's `serve --jobs` (0: the worker's default)
  double heartbeat_timeout_s = 5.0;  // the coordinator's --heartbeat-timeout
  std::string log_level = "info";
  std::string tensorboard_dir;  // the coordinator's --tensorboard ("" = none)
  // Store, coordinator and workers keep running when this process dies (`up --keep` hands
  // them over with Detach()); else the kernel sends them SIGTERM then (common/posix/subprocess.h).
  bool outlive_parent = false;
  // Each worker offers only this cluster's store (`serve --store NAME`), not every store of
  // the host (`lorastream up`); false: the worker's default, every live store.
  bool offer_own_store_only = false;
};

// Devices of this host: "cuda:i" for each visible GPU (common/posix/gpu_info.h: nvidia-smi or the
// driver's /proc folder, CUDA_VISIBLE_DEVICES respected), none when there is no GPU.
std::vector<std::string> DetectGpus();

// What the store serves for `model_dir`: the single file that lorastream-synth writes for a
// FLUX or Qwen-Image preset when `model_dir` is a folder holding it (and no config.json),
// else `model_dir` itself.
std::string ServedCheckpoint(const std::string& model_dir);
// The family of a checkpoint the store serves (after ServedCheckpoint): Qwen-Image's single
// file or diffusers folder, FLUX.1's, else an LLM's folder; as `lorastream-store serve` tells
// them apart.
ModelFamily CheckpointFamily(const std::string& path);

// The job file at `job_path` as a cluster submits it (TOML text): its base replaced by the
// store `store_name` and its output folder by `output_dir`, where the job names them ([model]
// store and [train] output_dir; a FLUX job written as one [flux] section: flux.store and
// flux.output_dir; a FLUX job's singles_per_unit dropped, the store's units being fixed), and
// the other relative paths it holds (its data and eval data, stats file, the adapter it
// starts from, a FLUX or Qwen-Image job's caches) made absolute against the file's folder.
// *replaced_output_dir gets the output folder the job named, when it named one other than
// `output_dir` ("" otherwise). Throws Error(kCorrupt) naming the file when it does not parse.
std::string ClusterJobText(const std::string& job_path, const std::string& store_name,
                           const std::string& output_dir,
                           std::string* replaced_output_dir = nullptr);

class LocalCluster {
 public:
  explicit LocalCluster(LocalClusterOptions options);
  ~LocalCluster();  // stops whatever still runs
  LocalCluster(const LocalCluster&) = delete;
  LocalCluster& operator=(const LocalCluster&) = delete;

  // Model (synthesized when needed), store, coordinator, workers; returns when every worker
  // has registered. Throws Error naming the part that failed and its log file.
  void Start();
  // Stops workers, coordinator and store, in that order (SIGTERM, then SIGKILL).
  void Stop();
  // Leaves every process running after this object is gone (`lorastream up --keep`).
  void Detach();

  void StartStore();
  void StopStore(int signal);  // SIGKILL simulates a crash, SIGTERM a clean stop
  void StartCoordinator();
  void StopCoordinator(int signal);
  void StartWorker(size_t index);
  void StopWorker(size_t index, int signal);
  size_t num_workers() const { return devices_.size(); }
  bool WorkerRunning(size_t index);
  pid_t WorkerPid(size_t index) const { return workers_.at(index).pid(); }
  pid_t StorePid() const { return store_.pid(); }

  // Copies a job file into run_dir/jobs/ as ClusterJobText writes it for this cluster's store
  // and run_dir/adapters/<file stem>, then submits it; returns the job id.
  // *replaced_output_dir gets the output folder the job named, when it named one other than the
  // cluster's ("" otherwise).
  int64_t Submit(const std::string& job_path, std::string* replaced_output_dir = nullptr);
  // Runs `lorastream ARGS --coordinator ENDPOINT` and returns its stdout; *exit_code gets its
  // exit status (throws when null and the status is not 0).
  std::string Client(const std::vector<std::string>& args, int* exit_code = nullptr,
                     double timeout_s = 60) const;
  // Polls `lorastream jobs --json` until every job is in a terminal state; returns the list.
  nlohmann::json WaitForJobs(double timeout_s);
  // `lorastream show ID --json`.
  nlohmann::json ShowJob(int64_t id) const;
  // Writes the pids of every running part, one per line, workers first, then the coordinator
  // and the store (for `up --keep`: `kill $(cat FILE)`).
  void WritePidFile(const std::string& path);
  // Writes run_dir/cluster.json ({endpoint, store, parts: [{part, pid}]} in the order they
  // stop: workers, coordinator, store), which `lorastream down` reads.
  void WriteClusterFile();

  const std::string& endpoint() const { return endpoint_; }
  const std::string& store_name() const { return store_name_; }
  const std::string& model_dir() const { return model_dir_; }
  // The family of the base the store serves (known once Start() ran).
  ModelFamily family() const { return family_; }
  const std::string& run_dir() const { return options_.run_dir; }
  std::string log_dir() const { return options_.run_dir + "/logs"; }
  const std::vector<std::string>& devices() const { return devices_; }

 private:
  std::string Bin(const std::string& name) const;
  void WaitForStore(double timeout_s);
  void WaitForWorkers(double timeout_s);

  LocalClusterOptions options_;
  std::string model_dir_;
  ModelFamily family_ = ModelFamily::kLlm;
  std::string store_name_;
  std::string endpoint_;
  std::vector<std::string> devices_;
  Subprocess store_;
  Subprocess coordinator_;
  std::vector<Subprocess> workers_;
};

}  // namespace lorastream::cli
