#include "coordinator/cli/local_cluster.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include <toml++/toml.h>
#include <nlohmann/json.hpp>

#include "common/base/error.h"
#include "common/base/log.h"
#include "common/formats/flux_config.h"
#include "common/formats/qwen_image_config.h"
#include "common/formats/toml_file.h"
#include "common/job/flux_job.h"
#include "common/job/job_paths.h"
#include "common/posix/gpu_info.h"
#include "common/posix/regular_file.h"
#include "common/posix/unique_fd.h"
#include "coordinator/client/curve.h"
#include "store/attach.h"
#include "store/synth_flux.h"
#include "store/synth_qwen_image.h"

namespace lorastream::cli {

namespace fs = std::filesystem;

namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string Tail(const std::string& path, size_t max_lines = 15) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  std::string out;
  for (size_t i = lines.size() > max_lines ? lines.size() - max_lines : 0; i < lines.size(); ++i)
    out += "    " + lines[i] + "\n";
  return out;
}

[[noreturn]] void PartFailed(const std::string& part, const std::string& log) {
  throw Error(ErrorCode::kIo,
              part + " failed to start; its log " + log + " ends with:\n" + Tail(log));
}

}  // namespace

std::vector<std::string> DetectGpus() { return VisibleCudaDevices(); }

std::string ServedCheckpoint(const std::string& model_dir) {
  std::error_code ec;
  if (!fs::is_directory(model_dir, ec) || fs::exists(model_dir + "/config.json", ec))
    return model_dir;
  for (const char* file : {store::kSynthFluxFile, store::kSynthQwenImageFile})
    if (fs::exists(model_dir + "/" + file, ec)) return model_dir + "/" + file;
  return model_dir;
}

ModelFamily CheckpointFamily(const std::string& path) {
  // Qwen-Image first: IsFluxCheckpointPath takes any file (and names what is wrong with it).
  if (IsQwenImageCheckpointPath(path)) return ModelFamily::kQwenImage;
  if (IsFluxCheckpointPath(path)) return ModelFamily::kFlux;
  return ModelFamily::kLlm;
}

LocalCluster::LocalCluster(LocalClusterOptions options) : options_(std::move(options)) {
  if (options_.run_dir.empty())
    throw Error(ErrorCode::kInvalidArgument, "LocalCluster: run_dir is required");
  fs::create_directories(log_dir());
  fs::create_directories(options_.run_dir + "/jobs");
  fs::create_directories(options_.run_dir + "/adapters");
  store_name_ =
      options_.store_name.empty() ? "up-" + std::to_string(getpid()) : options_.store_name;
  devices_ = options_.devices;
  if (devices_.empty()) devices_ = DetectGpus();
  if (devices_.empty()) devices_.assign(std::max(1, options_.cpu_workers), "cpu");
  workers_.resize(devices_.size());
  // Beside the default endpoint, in the owner-only folder: only this user reaches the cluster.
  endpoint_ = "ipc://" + client::DefaultRuntimeDir() + "/up-" + std::to_string(getpid()) + ".sock";
}

LocalCluster::~LocalCluster() {
  try {
    Stop();
  } catch (...) {
    // Destructors never throw; Stop() already sent the signals it could.
  }
}

std::string LocalCluster::Bin(const std::string& name) const {
  return options_.bin_dir.empty() ? name : options_.bin_dir + "/" + name;
}

void LocalCluster::Start() {
  if (options_.model_dir.empty()) {
    model_dir_ = options_.run_dir + "/model";
    if (!fs::exists(model_dir_ + "/config.json") && ServedCheckpoint(model_dir_) == model_dir_) {
      std::string log = log_dir() + "/synth.log";
      LS_LOG_INFO("writing a synthetic `{}` model to {}", options_.preset, model_dir_);
      SpawnOptions so;
      so.log_path = log;
      Subprocess synth = Subprocess::Spawn(
          {Bin("lorastream-synth"), "--preset", options_.preset, "--out", model_dir_, "--force"},
          so);
      if (synth.Wait(600) != 0) PartFailed("lorastream-synth", log);
    }
  } else {
    model_dir_ = fs::absolute(options_.model_dir).string();
  }
  // A folder holding the single file lorastream-synth writes for a FLUX or Qwen-Image preset
  // is served as that file.
  model_dir_ = ServedCheckpoint(model_dir_);
  family_ = CheckpointFamily(model_dir_);
  StartStore();
  StartCoordinator();
  for (size_t i = 0; i < workers_.size(); ++i) StartWorker(i);
  WaitForWorkers(120);
}

void LocalCluster::StartStore() {
  std::string log = log_dir() + "/store.log";
  SpawnOptions so;
  so.log_path = log;
  so.new_session = true;  // Ctrl-C reaches `up`, which stops the parts in order
  so.die_with_parent = !options_.outlive_parent;
  store_ =
      Subprocess::Spawn({Bin("lorastream-store"), "serve", model_dir_, "--name", store_name_}, so);
  WaitForStore(600);
}

void LocalCluster::WaitForStore(double timeout_s) {
  std::string log = log_dir() + "/store.log";
  double deadline = Now() + timeout_s;
  for (;;) {
    if (!store_.Running()) PartFailed("lorastream-store", log);
    try {
      store::AttachedStore probe = store::AttachedStore::Attach(store_name_);
      return;
    } catch (const Error& e) {
      if (e.code() != ErrorCode::kNotFound) throw;  // published but broken: say so now
    }
    if (Now() > deadline) PartFailed("lorastream-store (timed out)", log);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

void LocalCluster::StopStore(int signal) {
  if (!store_.valid()) return;
  if (signal == SIGKILL) {
    store_.Signal(SIGKILL);
    store_.Wait(30);
  } else {
    store_.Stop(30);
  }
}

void LocalCluster::StartCoordinator() {
  std::string log = log_dir() + "/coordinator.log";
  SpawnOptions so;
  so.log_path = log;
  so.new_session = true;
  so.die_with_parent = !options_.outlive_parent;
  std::ostringstream timeout;
  timeout << options_.heartbeat_timeout_s;
  std::vector<std::string> argv = {Bin("lorastream"),
                                   "coordinator",
                                   "--bind",
                                   endpoint_,
                                   "--db",
                                   options_.run_dir + "/journal.db",
                                   "--heartbeat-timeout",
                                   timeout.str(),
                                   "--log-level",
                                   options_.log_level};
  if (!options_.tensorboard_dir.empty()) {
    argv.push_back("--tensorboard");
    argv.push_back(options_.tensorboard_dir);
  }
  coordinator_ = Subprocess::Spawn(argv, so);
  // Ready when it answers a listing request.
  double deadline = Now() + 30;
  for (;;) {
    if (!coordinator_.Running()) PartFailed("lorastream coordinator", log);
    int code = 0;
    Client({"workers", "--json"}, &code, 5);
    if (code == 0) return;
    if (Now() > deadline) PartFailed("lorastream coordinator (not answering)", log);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

void LocalCluster::StopCoordinator(int signal) {
  if (!coordinator_.valid()) return;
  if (signal == SIGKILL) {
    coordinator_.Signal(SIGKILL);
    coordinator_.Wait(30);
  } else {
    coordinator_.Stop(30);
  }
}

void LocalCluster::StartWorker(size_t index) {
  LS_CHECK(index < workers_.size(), "worker index out of range");
  std::string log = log_dir() + "/worker-" + std::to_string(index) + ".log";
  SpawnOptions so;
  so.log_path = log;
  so.new_session = true;
  so.die_with_parent = !options_.outlive_parent;
  std::vector<std::string> argv = {
      Bin("lorastream-worker"), "serve", "--coordinator", endpoint_, "--device", devices_[index]};
  // CPU workers share this host's cores instead of each taking all of them (oversubscribed,
  // two CPU workers trained slower together than one alone).
  const auto cpu_workers = std::count(devices_.begin(), devices_.end(), std::string("cpu"));
  if (devices_[index] == "cpu" && cpu_workers > 1) {
    const long cores = std::max(1u, std::thread::hardware_concurrency());
    argv.insert(argv.end(), {"--threads", std::to_string(std::max(1L, cores / cpu_workers))});
  }
  if (options_.jobs_per_worker > 0)
    argv.insert(argv.end(), {"--jobs", std::to_string(options_.jobs_per_worker)});
  if (options_.offer_own_store_only) argv.insert(argv.end(), {"--store", store_name_});
  workers_[index] = Subprocess::Spawn(argv, so);
}

void LocalCluster::StopWorker(size_t index, int signal) {
  LS_CHECK(index < workers_.size(), "worker index out of range");
  if (signal == SIGKILL) {
    workers_[index].Signal(SIGKILL);
    workers_[index].Wait(30);
  } else {
    workers_[index].Stop(30);
  }
}

bool LocalCluster::WorkerRunning(size_t index) {
  return index < workers_.size() && workers_[index].Running();
}

void LocalCluster::WaitForWorkers(double timeout_s) {
  double deadline = Now() + timeout_s;
  for (;;) {
    for (size_t i = 0; i < workers_.size(); ++i)
      if (!workers_[i].Running())
        PartFailed("lorastream-worker " + devices_[i],
                   log_dir() + "/worker-" + std::to_string(i) + ".log");
    int code = 0;
    std::string out = Client({"workers", "--json"}, &code, 5);
    if (code == 0) {
      nlohmann::json j = nlohmann::json::parse(out, nullptr, false);
      size_t alive = 0;
      if (j.is_array())
        for (const auto& w : j)
          if (!w.is_object() || !w.contains("alive") || w["alive"] == true) ++alive;
      if (alive >= workers_.size()) return;
    }
    if (Now() > deadline)
      throw Error(ErrorCode::kTimeout, "workers did not register within " +
                                           std::to_string(int(timeout_s)) + " s; logs in " +
                                           log_dir());
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

std::string LocalCluster::Client(const std::vector<std::string>& args, int* exit_code,
                                 double timeout_s) const {
  // --coordinator is an option of the command itself, so it comes before the verb.
  std::vector<std::string> argv = {Bin("lorastream"), "--coordinator", endpoint_};
  argv.insert(argv.end(), args.begin(), args.end());
  int code = 0;
  std::string out = RunAndCapture(argv, &code, timeout_s, log_dir() + "/client.log");
  if (exit_code) {
    *exit_code = code;
  } else if (code != 0) {
    throw Error(ErrorCode::kIo, "`lorastream " + args.front() + "` exited with " +
                                    std::to_string(code) + "; see " + log_dir() + "/client.log");
  }
  return out;
}

std::string ClusterJobText(const std::string& job_path, const std::string& store_name,
                           const std::string& output_dir, std::string* replaced_output_dir) {
  toml::table job;
  bool flux_only = false;  // a FLUX job written as one [flux] section
  try {
    const std::string text = ReadRegularFile(job_path, kMaxTomlBytes, "job file");
    CheckTomlLimits(text, job_path);  // toml++ recurses per level: bounded first
    job = toml::parse(text, job_path);
    flux_only = job.contains("flux") && !HasSharedJobSections(TomlSection::Parse(text, job_path));
  } catch (const toml::parse_error& e) {
    throw Error(ErrorCode::kCorrupt, job_path + ": " + std::string(e.description()));
  }
  const std::string job_dir = JobFileDir(job_path);
  if (replaced_output_dir) {
    const toml::node* named =
        job.at_path(flux_only ? "flux.output_dir" : "train.output_dir").node();
    const std::string before =
        named && named->is_string() ? ResolveJobPath(named->as_string()->get(), job_dir) : "";
    *replaced_output_dir = before == output_dir ? "" : before;
  }
  if (job.contains("flux")) {
    // A FLUX job: its units are the store's.
    if (!job["flux"].is_table())
      throw Error(ErrorCode::kCorrupt, job_path + ": key `flux` must be a table");
    job["flux"].as_table()->erase("singles_per_unit");
  }
  if (flux_only) {
    // Written as one [flux] section: it names the store and the output folder there.
    toml::table& flux = *job["flux"].as_table();
    flux.erase("checkpoint");
    flux.insert_or_assign("store", store_name);
    flux.insert_or_assign("output_dir", output_dir);
  } else {
    toml::table model;
    model.insert("store", store_name);
    job.insert_or_assign("model", model);
    if (!job.contains("train")) job.insert("train", toml::table{});
    if (!job["train"].is_table())
      throw Error(ErrorCode::kCorrupt, job_path + ": key `train` must be a table");
    toml::table& train = *job["train"].as_table();
    train.insert_or_assign("output_dir", output_dir);
  }
  // The copy lives in another folder: the relative paths it holds are made absolute against
  // the original's folder, where they pointed (ResolveJobPath, the rule LoadJobSpec follows).
  // Every path a job file holds but the ones replaced above (model and output folders).
  for (const char* key : {"data.path", "eval.path", "train.stats_file", "lora.init_from",
                          "flux.init_from", "flux.cache_dir", "qwen_image.cache_dir"}) {
    toml::node* node = job.at_path(key).node();
    if (node && node->is_string()) {
      std::string& path = node->as_string()->get();
      path = ResolveJobPath(path, job_dir);
    }
  }
  std::ostringstream out;
  out << job << "\n";
  return out.str();
}

int64_t LocalCluster::Submit(const std::string& job_path, std::string* replaced_output_dir) {
  const std::string stem = fs::path(job_path).stem().string();
  const std::string text = ClusterJobText(
      job_path, store_name_, options_.run_dir + "/adapters/" + stem, replaced_output_dir);
  std::string copy = options_.run_dir + "/jobs/" + fs::path(job_path).filename().string();
  {
    std::ofstream out(copy);
    out << text;
    if (!out) throw Error(ErrorCode::kIo, "cannot write " + copy);
  }
  int code = 0;
  std::string out = Client({"submit", copy, "--json"}, &code);
  nlohmann::json j = nlohmann::json::parse(out, nullptr, false);
  if (j.is_object() && j.contains("job_id") && j["job_id"].is_number_integer())
    return j["job_id"].get<int64_t>();
  // Refused: say every problem the coordinator found, naming the job file the user gave.
  if (j.is_object() && j.contains("problems") && j["problems"].is_array() &&
      !j["problems"].empty()) {
    std::string problems;
    for (const auto& p : j["problems"])
      problems += "\n  " + (p.is_string() ? p.get<std::string>() : p.dump());
    throw Error(ErrorCode::kRefused, job_path + " was refused:" + problems);
  }
  throw Error(ErrorCode::kIo, "`lorastream submit` of " + job_path + " exited with " +
                                  std::to_string(code) + "; see " + log_dir() + "/client.log");
}

nlohmann::json LocalCluster::WaitForJobs(double timeout_s) {
  double deadline = Now() + timeout_s;
  for (;;) {
    int code = 0;
    std::string out = Client({"jobs", "--json"}, &code, 10);
    if (code == 0) {
      nlohmann::json jobs = nlohmann::json::parse(out, nullptr, false);
      bool all_done = jobs.is_array();
      if (all_done)
        for (const auto& job : jobs) {
          std::string state = job.value("state", "");
          if (state != "succeeded" && state != "failed" && state != "cancelled") all_done = false;
        }
      if (all_done) return jobs;
    }
    if (Now() > deadline)
      throw Error(ErrorCode::kTimeout, "jobs did not finish within " +
                                           std::to_string(int(timeout_s)) + " s; logs in " +
                                           log_dir());
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
  }
}

nlohmann::json LocalCluster::ShowJob(int64_t id) const {
  std::string out = Client({"show", std::to_string(id), "--json"});
  nlohmann::json j = nlohmann::json::parse(out, nullptr, false);
  if (!j.is_object())
    throw Error(ErrorCode::kProtocol, "unexpected reply of `lorastream show --json`: " + out);
  return j;
}

void LocalCluster::WritePidFile(const std::string& path) {
  std::ofstream out(path);
  for (size_t i = 0; i < workers_.size(); ++i)
    if (workers_[i].Running()) out << workers_[i].pid() << "\n";
  if (coordinator_.Running()) out << coordinator_.pid() << "\n";
  if (store_.Running()) out << store_.pid() << "\n";
  if (!out) throw Error(ErrorCode::kIo, "cannot write " + path);
}

void LocalCluster::WriteClusterFile() {
  nlohmann::json parts = nlohmann::json::array();
  for (size_t i = 0; i < workers_.size(); ++i)
    if (workers_[i].Running())
      parts.push_back({{"part", "worker " + devices_[i]}, {"pid", workers_[i].pid()}});
  if (coordinator_.Running())
    parts.push_back({{"part", "coordinator"}, {"pid", coordinator_.pid()}});
  if (store_.Running()) parts.push_back({{"part", "store"}, {"pid", store_.pid()}});
  const nlohmann::json j{{"endpoint", endpoint_}, {"store", store_name_}, {"parts", parts}};
  const std::string path = options_.run_dir + "/cluster.json";
  std::ofstream out(path);
  out << j.dump(2) << "\n";
  if (!out) throw Error(ErrorCode::kIo, "cannot write " + path);
}

void LocalCluster::Stop() {
  for (size_t i = 0; i < workers_.size(); ++i)
    if (workers_[i].valid()) workers_[i].Stop(30);
  if (coordinator_.valid()) {
    coordinator_.Stop(30);
    // A coordinator that had to be killed leaves its socket file: remove it (it was ours).
    std::error_code ec;
    fs::remove(endpoint_.substr(std::string("ipc://").size()), ec);
  }
  if (store_.valid()) store_.Stop(30);
}

void LocalCluster::Detach() {
  for (auto& w : workers_) w.Detach();
  coordinator_.Detach();
  store_.Detach();
}

}  // namespace lorastream::cli
