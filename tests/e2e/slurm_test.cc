// End-to-end against a real Slurm (Debian's slurm-wlm): a slurmctld and two slurmd "nodes" on
// this machine (multiple-slurmd: n1 and n2 on their own loopback ports), auth/none, started
// and stopped by the test in a temporary folder. `lorastream slurm` writes the pilot's script
// and submits it with sbatch; the test trains four jobs on its four CPU workers, loses node n2
// (its slurmd, slurmstepds, store and workers killed) while every job is mid-run, and checks
// that every job succeeds with the adapter the same job trains on one host, bit for bit; then
// the pilot is requeued and its coordinator finds every job in its journal.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "common/posix/shm_names.h"
#include "common/posix/subprocess.h"
#include "tests/e2e/e2e_jobs.h"
#include "tests/support/test_support.h"

using lorastream::RunAndCapture;
using lorastream::SpawnOptions;
using lorastream::Subprocess;
using namespace lorastream::testing;
namespace fs = std::filesystem;

namespace {

// slurmd runs every job step as its user and needs root; elsewhere CTest reports the test as
// skipped (SKIP_RETURN_CODE 77, tests/CMakeLists.txt) rather than passed.
const bool kRunsAsRoot = [] {
  if (::geteuid() == 0) return true;
  std::fprintf(stderr, "the Slurm test starts slurmd, which needs root: skipped\n");
  std::exit(77);
}();

std::string Trimmed(std::string text) {
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.pop_back();
  return text;
}

// The environment a process started with, one "KEY=VALUE" a line ("" once it is gone).
std::string EnvironOf(pid_t pid) {
  std::string env = ReadAll("/proc/" + std::to_string(pid) + "/environ");
  std::replace(env.begin(), env.end(), '\0', '\n');
  return "\n" + env;
}

bool HasEnv(pid_t pid, const std::string& entry) {
  return EnvironOf(pid).find("\n" + entry + "\n") != std::string::npos;
}

std::vector<pid_t> ProcessesWithEnv(const std::string& entry) {
  std::vector<pid_t> pids;
  for (const auto& e : fs::directory_iterator("/proc")) {
    const std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    const pid_t pid = std::stoi(name);
    if (pid != ::getpid() && HasEnv(pid, entry)) pids.push_back(pid);
  }
  return pids;
}

pid_t ParentOf(pid_t pid) {
  std::istringstream stat(ReadAll("/proc/" + std::to_string(pid) + "/stat"));
  std::string skip;
  pid_t parent = 0;
  stat >> skip >> skip >> skip >> parent;  // comm has no space here (our own executables)
  return parent;
}

// Removes, when it goes, what a test's stores left in /dev/shm (a killed store unlinks
// nothing): every object whose name starts with `prefix`.
struct ShmSweep {
  std::string prefix;
  ~ShmSweep() {
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(lorastream::kShmDir, ec))
      if (e.path().filename().string().rfind(prefix, 0) == 0) fs::remove(e.path(), ec);
  }
};

// slurmctld and one slurmd per node on loopback, their state, spool, logs and fake GPUs in
// `dir`; Slurm's commands find it through SLURM_CONF, set for this process and its children.
class LocalSlurm {
 public:
  LocalSlurm(const std::string& dir, const std::vector<std::string>& nodes, int cpus_per_node)
      : dir_(dir), conf_(dir + "/slurm.conf"), nodes_(nodes) {
    for (const std::string& sub : {"state", "log", "spool"})
      fs::create_directories(dir_ + "/" + sub);
    std::ofstream conf(conf_);
    conf << "ClusterName=lorastream\n"
         << "SlurmctldHost=localhost(127.0.0.1)\n"
         << "SlurmctldPort=" << FreeLoopbackPort() << "\n"
         << "SlurmUser=root\nSlurmdUser=root\n"
         << "AuthType=auth/none\nCredType=cred/none\n"
         << "StateSaveLocation=" << dir_ << "/state\n"
         << "SlurmdSpoolDir=" << dir_ << "/spool/%n\n"
         << "SlurmctldPidFile=" << dir_ << "/slurmctld.pid\n"
         << "SlurmdPidFile=" << dir_ << "/slurmd-%n.pid\n"
         << "SlurmctldLogFile=" << dir_ << "/log/slurmctld.log\n"
         << "SlurmdLogFile=" << dir_ << "/log/slurmd-%n.log\n"
         << "ProctrackType=proctrack/pgid\nTaskPlugin=task/none\nMpiDefault=none\n"
         << "SelectType=select/cons_tres\nSelectTypeParameters=CR_CPU\n"
         << "SchedulerType=sched/builtin\nReturnToService=2\n"
         << "SlurmdParameters=config_overrides\n"  // the configured CPUs, not this machine's
         << "SlurmdTimeout=5\nMessageTimeout=5\nKillWait=2\nInactiveLimit=0\n"
         << "JobAcctGatherType=jobacct_gather/none\nAccountingStorageType=accounting_storage/none\n"
         << "GresTypes=gpu\n";
    for (const std::string& node : nodes_)
      conf << "NodeName=" << node
           << " NodeAddr=127.0.0.1 NodeHostname=localhost Port=" << FreeLoopbackPort()
           << " CPUs=" << cpus_per_node << " Gres=gpu:2 State=UNKNOWN\n";
    conf << "PartitionName=main Default=YES MaxTime=INFINITE State=UP Nodes=";
    for (size_t i = 0; i < nodes_.size(); ++i) conf << (i ? "," : "") << nodes_[i];
    conf << "\n";
    // Two fake GPUs a node (the null device): the pilot here runs CPU workers, but the nodes
    // are configured as a GPU cluster's are.
    std::ofstream gres(dir_ + "/gres.conf");
    gres << "AutoDetect=off\n";
    int gpu = 0;
    for (const std::string& node : nodes_) {
      for (int i = 0; i < 2; ++i, ++gpu) {
        const std::string device = dir_ + "/gpu" + std::to_string(gpu);
        REQUIRE(::mknod(device.c_str(), S_IFCHR | 0666, makedev(1, 3)) == 0);
        gres << "NodeName=" << node << " Name=gpu File=" << device << "\n";
      }
    }
    conf.close();
    gres.close();
    ::setenv("SLURM_CONF", conf_.c_str(), 1);
    ctld_ = Subprocess::Spawn({LORASTREAM_SLURMCTLD, "-D", "-i", "-f", conf_},
                              {dir_ + "/log/slurmctld.out", {}, false, true});
    for (const std::string& node : nodes_) StartNode(node);
    WaitUntil(
        [&] {
          int code = -1;
          const std::string states = RunAndCapture({"sinfo", "-h", "-N", "-o", "%t"}, &code, 30);
          return code == 0 &&
                 std::count(states.begin(), states.end(), '\n') ==
                     static_cast<long>(nodes_.size()) &&
                 states.find_first_not_of("idle\n") == std::string::npos;
        },
        60, "every Slurm node idle (logs: " + dir_ + "/log)");
  }

  ~LocalSlurm() {
    // Whatever the test left of its jobs (the lost node's store never unlinked its memory):
    // every process started with this slurm.conf, asked to end, then killed.
    const std::string mine = "SLURM_CONF=" + conf_;
    for (pid_t pid : ProcessesWithEnv(mine))
      if (pid != ctld_.pid()) ::kill(pid, SIGTERM);
    WaitFor([&] { return ProcessesWithEnv(mine).size() <= 1; }, 20);
    for (pid_t pid : ProcessesWithEnv(mine))
      if (pid != ctld_.pid()) ::kill(pid, SIGKILL);
    slurmd_.clear();
    ctld_.Stop(10);
    ::unsetenv("SLURM_CONF");
  }

  LocalSlurm(const LocalSlurm&) = delete;
  LocalSlurm& operator=(const LocalSlurm&) = delete;

  void StartNode(const std::string& node) {
    slurmd_[node] = Subprocess::Spawn({LORASTREAM_SLURMD, "-D", "-N", node, "-f", conf_},
                                      {dir_ + "/log/slurmd-" + node + ".out", {}, false, true});
  }

  // A node lost as a whole host is: its slurmd, its slurmstepds and every task it ran, killed.
  void KillNode(const std::string& node) {
    slurmd_.at(node).Signal(SIGKILL);
    slurmd_.at(node).Wait(30);
    std::vector<pid_t> tasks;
    for (pid_t pid : ProcessesWithEnv("SLURMD_NODENAME=" + node))
      if (HasEnv(pid, "SLURM_CONF=" + conf_)) tasks.push_back(pid);
    REQUIRE(!tasks.empty());
    for (pid_t task : tasks) {
      const pid_t stepd = ParentOf(task);
      if (Trimmed(ReadAll("/proc/" + std::to_string(stepd) + "/comm")) == "slurmstepd")
        ::kill(stepd, SIGKILL);
    }
    for (pid_t task : tasks) ::kill(task, SIGKILL);
  }

 private:
  std::string dir_, conf_;
  std::vector<std::string> nodes_;
  Subprocess ctld_;
  std::map<std::string, Subprocess> slurmd_;
};

}  // namespace

TEST_CASE("a Slurm pilot on two nodes trains four jobs; a node lost mid-run changes no adapter",
          "[slurm]") {
  REQUIRE(kRunsAsRoot);
  const TempDir tmp("slurm");
  const std::string dir = tmp.str();
  const std::string store = "slurmtest" + std::to_string(::getpid());
  const ShmSweep sweep{"lorastream." + store + "-"};
  LocalSlurm slurm(dir + "/slurm", {"n1", "n2"}, 4);
  int code = -1;
  RunAndCapture({Bin("lorastream-synth"), "--preset", "tiny", "--out", dir + "/model"}, &code, 120);
  REQUIRE(code == 0);

  // The pilot: two nodes of two CPU workers, a coordinator on the first node.
  const std::string keys = dir + "/keys", run = dir + "/run";
  std::vector<std::string> pilot = {Bin("lorastream")};
  std::istringstream words("slurm --model " + dir + "/model --store " + store +
                           " --nodes 2 --cpu-workers-per-node 2 --threads 1 --keys " + keys +
                           " --run-dir " + run + " --port " + std::to_string(FreeLoopbackPort()) +
                           " --heartbeat-timeout 3 --partition main --time 15 --requeue --submit");
  for (std::string word; words >> word;) pilot.push_back(word);
  const std::string said = RunAndCapture(pilot, &code, 60);
  INFO(said);
  REQUIRE(code == 0);
  std::smatch match;
  REQUIRE(std::regex_search(said, match, std::regex("submitted: Slurm job ([0-9]+)")));
  const std::string slurm_job = match[1];
  INFO("the pilot's logs: " << run << "/logs");
  WaitUntil([&] { return fs::exists(run + "/coordinator.endpoint"); }, 60, "the pilot to start");
  const std::string endpoint = Trimmed(ReadAll(run + "/coordinator.endpoint"));
  auto client = [&](std::vector<std::string> args) {
    args.insert(args.begin(), {Bin("lorastream"), "--coordinator", endpoint, "--curve-keys",
                               keys + "/client", "--timeout", "5"});
    int exit_code = -1;
    std::string out = RunAndCapture(args, &exit_code, 60);
    return exit_code == 0 ? out : std::string();
  };
  auto json_of = [&](const std::vector<std::string>& args) {
    const std::string out = client(args);
    return out.empty() ? nlohmann::json::array() : nlohmann::json::parse(out);
  };

  // Four workers, each offering its own node's store (named after the node and the Slurm
  // job) under the one name the jobs give.
  WaitUntil(
      [&] {
        return json_of({"workers", "--json"}).size() == 4;
      },
      120, "four workers registered");
  for (const std::string& node : {"n1", "n2"})
    CHECK(fs::exists(std::string(lorastream::kShmDir) +
                     lorastream::ManifestShmName(store + "-" + node + "-" + slurm_job)));
  std::map<std::string, std::vector<pid_t>> workers_on;
  for (const auto& w : json_of({"workers", "--json"})) {
    const pid_t pid = w.value("pid", 0);
    for (const std::string& node : {"n1", "n2"})
      if (HasEnv(pid, "SLURMD_NODENAME=" + node)) workers_on[node].push_back(pid);
    REQUIRE(::kill(pid, SIGUSR1) == 0);  // hold each job right after its first checkpoint
  }
  REQUIRE(workers_on["n1"].size() == 2);
  REQUIRE(workers_on["n2"].size() == 2);

  std::vector<std::string> data;
  for (int j = 0; j < 4; ++j) {
    data.push_back(WriteData(dir, 60, 300 + j));
    const std::string name = "job" + std::to_string(j);
    REQUIRE(!client({"submit", "-q",
                     WriteJob(dir, name, store, data[j], 16, 4, j, dir + "/out/" + name)})
                 .empty());
  }
  // Every job mid-run on its own worker, held at its first checkpoint; then n2 is lost.
  WaitUntil(
      [&] {
        const nlohmann::json jobs = json_of({"jobs", "--json"});
        return jobs.size() == 4 && std::all_of(jobs.begin(), jobs.end(), [](const auto& j) {
                 return j["state"] == "running" && j.value("checkpoint_step", 0) == 4;
               });
      },
      120, "four jobs held at their first checkpoint");
  slurm.KillNode("n2");
  for (pid_t pid : workers_on["n1"]) REQUIRE(::kill(pid, SIGUSR2) == 0);

  WaitUntil(
      [&] {
        const nlohmann::json jobs = json_of({"jobs", "--json"});
        return jobs.size() == 4 && std::none_of(jobs.begin(), jobs.end(), [](const auto& j) {
                 return j["state"] == "queued" || j["state"] == "running";
               });
      },
      240, "every job to end");
  const nlohmann::json jobs = json_of({"jobs", "--json"});
  int resumed = 0;
  for (const auto& job : jobs) {
    INFO(job.dump());
    CHECK(job["state"] == "succeeded");
    if (job.value("attempt", 0) >= 2) ++resumed;
  }
  CHECK(resumed == 2);  // the two jobs of n2's workers, requeued from their checkpoints
  // The pilot goes on without n2.
  CHECK(Trimmed(RunAndCapture({"squeue", "-h", "-j", slurm_job, "-o", "%T"}, &code, 30)) ==
        "RUNNING");

  // Each adapter equals the same job trained alone against n1's store.
  for (int j = 0; j < 4; ++j) {
    const std::string name = "job" + std::to_string(j);
    const std::string alone = dir + "/alone/" + name;
    TrainStandalone(
        WriteJob(dir, name + "-alone", store + "-n1-" + slurm_job, data[j], 16, 4, j, alone),
        dir + "/alone-" + name + ".log");
    RequireSameAdapter(dir + "/out/" + name, alone);
  }

  // --requeue: Slurm starts the pilot again, as it does when its first node is lost (here by
  // `scontrol requeue` once n2 is back, and at once rather than after Slurm's delay); the new
  // coordinator reloads every job from the journal and the workers register with it.
  slurm.StartNode("n2");
  auto pilot_state = [&] {
    return Trimmed(RunAndCapture({"squeue", "-h", "-j", slurm_job, "-o", "%T"}, &code, 30));
  };
  RunAndCapture({"scontrol", "requeue", slurm_job}, &code, 30);
  REQUIRE(code == 0);
  WaitUntil([&] { return pilot_state() == "PENDING"; }, 60, "the pilot requeued");
  RunAndCapture({"scontrol", "update", "jobid=" + slurm_job, "StartTime=now"}, &code, 30);
  WaitUntil([&] { return pilot_state() == "RUNNING"; }, 60, "the pilot running again");
  WaitUntil(
      [&] {
        return json_of({"workers", "--json"}).size() == 4;
      },
      120, "four workers registered with the restarted coordinator");
  const nlohmann::json reloaded = json_of({"jobs", "--json"});
  REQUIRE(reloaded.size() == 4);
  for (const auto& job : reloaded) CHECK(job["state"] == "succeeded");
  data.push_back(WriteData(dir, 60, 304));
  REQUIRE(
      !client({"submit", "-q", WriteJob(dir, "job4", store, data[4], 8, 4, 4, dir + "/out/job4")})
           .empty());
  auto state_of_job4 = [&] {
    for (const auto& job : json_of({"jobs", "--json"}))
      if (job["name"] == "job4") return job["state"].get<std::string>();
    return std::string();
  };
  WaitUntil([&] { return state_of_job4() != "queued" && state_of_job4() != "running"; }, 120,
            "a job submitted to the restarted pilot to end");
  CHECK(state_of_job4() == "succeeded");

  RunAndCapture({"scancel", slurm_job}, &code, 30);
  WaitUntil(
      [&] {
        return Trimmed(RunAndCapture({"squeue", "-h", "-j", slurm_job}, &code, 30)).empty();
      },
      60, "the pilot to end");
  // n1's store unlinked its memory when the pilot ended; n2's, killed, left it behind.
  for (const auto& e : fs::directory_iterator(lorastream::kShmDir)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(lorastream::ShmPrefix(store + "-n2-" + slurm_job), 0) == 0)
      fs::remove(e.path());
    else
      CHECK(name.rfind("lorastream." + store, 0) != 0);
  }
}
