// Multi-process test harness: a real `lorastream coordinator` on an ipc:// socket in a fresh
// folder, test-driver workers (lorastream-test-worker), job files, and polling helpers.
#pragma once

#include <unistd.h>

#include <chrono>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "common/posix/subprocess.h"
#include "coordinator/client/client.h"
#include "tests/support/test_support.h"

namespace lorastream::testing {

namespace fs = std::filesystem;

// Spawn options that only redirect the output to `path`.
inline SpawnOptions LogTo(const std::string& path) {
  SpawnOptions o;
  o.log_path = path;
  return o;
}

class Cluster {
 public:
  explicit Cluster(const std::string& name) : temp_(name), dir_(temp_.path()) {
    std::ofstream(dir_ / "data.jsonl") << "{\"text\": \"hello\"}\n";
    endpoint_ = "ipc://" + (dir_ / "coordinator.sock").string();
  }
  ~Cluster() {
    for (Subprocess& w : workers_)
      if (w.valid()) w.Stop(5);
    if (coordinator_.valid()) coordinator_.Stop(5);
  }

  const fs::path& dir() const { return dir_; }
  const std::string& endpoint() const { return endpoint_; }
  Subprocess& coordinator() { return coordinator_; }

  // `curve_keys`: the keys folder when the coordinator runs with --curve-keys (the probe
  // that waits for it to come up must authenticate).
  void StartCoordinator(std::vector<std::string> extra = {}, const std::string& curve_keys = "") {
    std::vector<std::string> argv = {Bin("lorastream"),
                                     "coordinator",
                                     "--bind",
                                     endpoint_,
                                     "--db",
                                     (dir_ / "journal.db").string(),
                                     "--heartbeat-interval",
                                     "0.2",
                                     "--heartbeat-timeout",
                                     "3",
                                     "--reconcile-timeout",
                                     "10"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    coordinator_ = Subprocess::Spawn(argv, LogTo((dir_ / "coordinator.log").string()));
    client::Client client = NewClient(500, curve_keys);
    bool up = WaitFor(
        [&] {
          try {
            client.Call(ListJobsRequest{});
            return true;
          } catch (const Error&) {
            return false;
          }
        },
        20);
    if (!up)
      throw Error(ErrorCode::kTimeout, "coordinator did not come up; see " + Log("coordinator"));
  }

  // A test-driver worker on "host" with the given stores ("name:fingerprint").
  Subprocess& StartWorker(const std::string& host, const std::vector<std::string>& stores,
                          int step_ms = 30, const std::vector<std::string>& extra_args = {}) {
    std::vector<std::string> argv = {
        Bin("lorastream-test-worker"), "--coordinator", endpoint_, "--host", host, "--step-ms",
        std::to_string(step_ms)};
    argv.insert(argv.end(), extra_args.begin(), extra_args.end());
    for (const std::string& s : stores) {
      argv.push_back("--store");
      argv.push_back(s);
    }
    workers_.push_back(
        Subprocess::Spawn(argv, LogTo((dir_ / ("worker-" + host + ".log")).string())));
    return workers_.back();
  }

  std::string WriteJob(const std::string& name, int steps, int checkpoint_every = 0,
                       int priority = 0, const std::string& store = "tiny") {
    fs::path path = dir_ / (name + ".toml");
    std::ofstream(path) << "name = \"" << name << "\"\npriority = " << priority
                        << "\n[model]\nstore = \"" << store << "\"\n[data]\npath = \""
                        << (dir_ / "data.jsonl").string() << "\"\n[train]\nsteps = " << steps
                        << "\ncheckpoint_every = " << checkpoint_every << "\noutput_dir = \""
                        << (dir_ / ("out-" + name)).string() << "\"\n";
    return path.string();
  }

  // `lorastream ARGS...` against this coordinator; returns stdout, *code its exit status.
  std::string Cli(std::vector<std::string> args, int* code, double timeout_s = 60) {
    std::vector<std::string> argv = {Bin("lorastream"), "--coordinator", endpoint_};
    argv.insert(argv.end(), args.begin(), args.end());
    return RunAndCapture(argv, code, timeout_s, (dir_ / "cli.stderr").string());
  }

  int64_t Submit(const std::string& job_file) {
    int code = -1;
    std::string out = Cli({"submit", "-q", job_file}, &code);
    if (code != 0)
      throw Error(ErrorCode::kRefused, "submit failed (" + std::to_string(code) + "): " + out);
    return std::stoll(out);
  }

  client::Client NewClient(int timeout_ms = 5000, const std::string& curve_keys = "") const {
    return client::Client(client::ClientOptions{endpoint_, curve_keys, timeout_ms});
  }

  JobSummary Job(int64_t id) {
    client::Client client = NewClient();
    return client.Call(ShowJobRequest{id}).job;
  }

  int ListWorkersAlive() {
    client::Client client = NewClient();
    int alive = 0;
    for (const WorkerSummary& w : client.Call(ListWorkersRequest{false}).workers) alive += w.alive;
    return alive;
  }

  bool WaitState(int64_t id, JobState state, double timeout_s) {
    return WaitFor(
        [&] {
          try {
            return Job(id).state == state;
          } catch (const Error&) {
            return false;
          }
        },
        timeout_s);
  }

  std::string Log(const std::string& name) const {
    std::ifstream in(dir_ / (name + ".log"));
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    return name + ".log:\n" + text;
  }

  std::string ReadOutput(const std::string& job, const std::string& file) const {
    std::ifstream in(dir_ / ("out-" + job) / file);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }

 private:
  TempDir temp_;  // declared first: removed after the processes writing into it stopped
  fs::path dir_;
  std::string endpoint_;
  Subprocess coordinator_;
  std::deque<Subprocess> workers_;  // deque: StartWorker hands out stable references
};

}  // namespace lorastream::testing
