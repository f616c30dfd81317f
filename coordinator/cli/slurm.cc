#include "coordinator/cli/slurm.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <ostream>
#include <regex>
#include <sstream>

#include "common/base/error.h"
#include "common/formats/flux_config.h"
#include "common/posix/install_paths.h"
#include "common/posix/shm_names.h"
#include "common/posix/subprocess.h"
#include "coordinator/cli/up.h"
#include "coordinator/client/curve.h"
#include "coordinator/daemon/coordinator.h"

namespace lorastream::cli {
namespace fs = std::filesystem;
namespace {

// The files of a worker's --curve-keys folder (LoadClientKeys(dir, "worker")) and the
// coordinator's list that admits its key as a worker's, never as a client's.
constexpr const char* kWorkerKeyStem = "worker";
constexpr const char* kWorkerAdmitList = "authorized_workers";

// A store name of a pilot is STORE-NODE-JOBID (at most 64 characters): the name jobs give
// must leave room for a node's name and a Slurm job id.
constexpr size_t kMaxPilotStoreName = 32;

void MakePrivateDir(const fs::path& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw Error(ErrorCode::kIo, "cannot create " + dir.string() + ": " + ec.message());
  client::EnsureOwnerOnlyDir(dir.string());
}

// Writes `dir`/STEM.pub and STEM.key (0600) from a fresh key pair; returns the public key.
// A line of authorized_clients that starts with '#' is a comment, and '#' is a Z85 digit: a
// public key that starts with it could never be admitted, so such a pair is drawn again.
std::string WriteKeyPair(const fs::path& dir, const std::string& stem) {
  client::CurveKeyPair pair = client::NewCurveKeyPair();
  while (pair.public_key[0] == '#') pair = client::NewCurveKeyPair();
  client::WriteCurveKeyFile((dir / (stem + ".pub")).string(), pair.public_key, false);
  client::WriteCurveKeyFile((dir / (stem + ".key")).string(), pair.secret_key, true);
  return pair.public_key;
}

void CopyKey(const fs::path& from, const fs::path& to) {
  client::WriteCurveKeyFile(to.string(), client::ReadCurveKeyFile(from.string()), false);
}

// Appends "KEY  # why" to an admit list (created when missing).
void Admit(const fs::path& list, const std::string& public_key, const std::string& why) {
  const std::string line = public_key + "  # " + why;
  if (!fs::exists(list)) {
    client::WriteCurveKeyFile(list.string(), line, false);
    return;
  }
  std::ofstream out(list, std::ios::app);
  if (!(out << line << "\n") || !out.flush())
    throw Error(ErrorCode::kIo, "cannot append to " + list.string());
}

// Shell words as bash reads them back: bare when nothing in them is special, else in single
// quotes.
std::string ShellQuote(const std::string& text) {
  static const std::regex plain("[A-Za-z0-9_./:=@%+,-]+");
  if (std::regex_match(text, plain)) return text;
  std::string out = "'";
  for (char c : text) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// Seconds as a person writes them: 3600, 2.5.
std::string Seconds(double seconds) {
  std::ostringstream s;
  s << seconds;
  return s.str();
}

// A value that goes onto one line of the script (an #SBATCH line, say).
void RequireOneLine(const std::string& what, const std::string& value) {
  if (value.find_first_of("\n\r") != std::string::npos)
    throw Error(ErrorCode::kInvalidArgument, what + " must be one line");
}

// The checked options: defaults filled, paths absolute.
SlurmOptions Checked(SlurmOptions o) {
  auto bad = [](const std::string& why) { throw Error(ErrorCode::kInvalidArgument, why); };
  if (o.nodes < 1) bad("--nodes must be at least 1");
  if ((o.gpus_per_node > 0) == (o.cpu_workers_per_node > 0))
    bad("give exactly one of --gpus-per-node (a worker per GPU) and --cpu-workers-per-node");
  if (o.gpus_per_node < 0 || o.cpu_workers_per_node < 0 || o.worker_threads < 0 ||
      o.jobs_per_gpu < 0 || o.cpus_per_task < 0)
    bad("--gpus-per-node, --cpu-workers-per-node, --threads, --cpus-per-task and "
        "--jobs-per-gpu cannot be negative");
  RequireOneLine("--mem", o.mem);
  if (o.port < 1 || o.port > 65535) bad("--port must be in 1..65535");
  if (o.keys_dir.empty()) bad("--keys names the folder of the CURVE keys (on shared storage)");
  if (!o.model_dir.empty()) {
    o.model_dir = fs::absolute(o.model_dir).lexically_normal().string();
    // A FLUX.1 checkpoint (BFL's file or a diffusers folder) is served as a model folder is.
    std::string flux_problem;
    if (!fs::is_regular_file(fs::path(o.model_dir) / "config.json")) {
      try {
        DetectFluxCheckpoint(o.model_dir);
      } catch (const Error& e) {
        flux_problem = e.what();
      }
    }
    if (!flux_problem.empty())
      bad("--model " + o.model_dir +
          " is not a model folder here (no config.json) nor a FLUX.1 checkpoint (" + flux_problem +
          "); every node must see it at that path");
    if (o.store.empty()) {
      const fs::path model(o.model_dir);  // a BFL file is named without its .safetensors
      o.store = (fs::is_regular_file(model) ? model.stem() : model.filename()).string();
      for (char& c : o.store)
        if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '-') c = '_';
      if (o.store.size() > kMaxPilotStoreName) o.store.resize(kMaxPilotStoreName);
    }
  }
  if (o.store.empty()) bad("give --model (a store per node loads it) or --store (one runs there)");
  ValidateStoreName(o.store);
  if (!o.model_dir.empty() && o.store.size() > kMaxPilotStoreName)
    bad("--store " + o.store + " is longer than " + std::to_string(kMaxPilotStoreName) +
        " characters: each node's store adds its node's name and the Slurm job id, within 64");
  if (!o.coordinator.empty() && o.coordinator.rfind("tcp://", 0) != 0)
    bad("--coordinator " + o.coordinator +
        ": the nodes reach a coordinator over tcp:// (with CURVE); an ipc:// endpoint serves "
        "one host only");
  if (o.heartbeat_timeout_s < 0) bad("--heartbeat-timeout cannot be negative");
  if (o.store_wait_s < 0) bad("--store-wait cannot be negative");
  if (o.heartbeat_timeout_s == 0)
    o.heartbeat_timeout_s = coordinator::CoordinatorOptions{}.heartbeat_timeout_s;
  RequireOneLine("--partition", o.partition);
  RequireOneLine("--time", o.time);
  RequireOneLine("--account", o.account);
  RequireOneLine("--job-name", o.job_name);
  for (std::string& line : o.sbatch_lines) {
    RequireOneLine("--sbatch", line);
    if (line.rfind("#SBATCH", 0) == 0) line = line.substr(7);
    line.erase(0, line.find_first_not_of(' '));
    if (line.empty()) bad("--sbatch needs an option, e.g. --sbatch=--constraint=h200");
  }
  o.run_dir = fs::absolute(o.run_dir.empty() ? DefaultRunDir("slurm") : o.run_dir)
                  .lexically_normal()
                  .string();
  if (o.run_dir.find_first_of(" \t\n\r") != std::string::npos)
    bad("the run folder " + o.run_dir +
        " has a space in its path, which #SBATCH --output "
        "cannot hold: name another with --run-dir");
  o.keys_dir = fs::absolute(o.keys_dir).lexically_normal().string();
  if (o.bin_dir.empty()) o.bin_dir = SelfExeDir();
  if (o.configs_dir.empty()) o.configs_dir = ConfigsDir();
  return o;
}

// The CPUs of a CPU worker's task: --cpus-per-task, else its threads (at least one).
int CpuWorkerCpus(const SlurmOptions& o) {
  return o.cpus_per_task > 0 ? o.cpus_per_task : std::max(1, o.worker_threads);
}

std::string SbatchLines(const SlurmOptions& o) {
  std::ostringstream s;
  auto line = [&](const std::string& option, const std::string& why = "") {
    s << "#SBATCH " << option << (why.empty() ? "" : "  # " + why) << "\n";
  };
  line("--job-name=" + o.job_name);
  line("--nodes=" + std::to_string(o.nodes));
  if (o.gpus_per_node > 0) {
    line("--ntasks-per-node=" + std::to_string(o.gpus_per_node), "one worker per GPU");
    line("--gpus-per-node=" + std::to_string(o.gpus_per_node));
    if (o.cpus_per_task > 0) line("--cpus-per-task=" + std::to_string(o.cpus_per_task));
  } else {
    line("--ntasks-per-node=" + std::to_string(o.cpu_workers_per_node), "CPU workers");
    line("--cpus-per-task=" + std::to_string(CpuWorkerCpus(o)));
  }
  if (!o.mem.empty())
    line("--mem=" + o.mem, "memory per node: the store's copy of the model and more");
  if (o.exclusive) line("--exclusive", "the nodes are the pilot's alone");
  line("--no-kill", "a lost node ends its own tasks; the pilot goes on with the others");
  line(o.requeue ? "--requeue" : "--no-requeue",
       o.requeue ? "restarted when its first node is lost; workers register again" : "");
  line("--output=" + o.run_dir + "/logs/pilot-%j.out");
  line("--open-mode=append");
  if (!o.partition.empty()) line("--partition=" + o.partition);
  if (!o.time.empty()) line("--time=" + o.time);
  if (!o.account.empty()) line("--account=" + o.account);
  for (const std::string& extra : o.sbatch_lines) line(extra);
  std::string text = s.str();
  text.pop_back();  // the template's line ends it
  return text;
}

std::string ReadTemplate(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw Error(ErrorCode::kNotFound, "cannot read the pilot's template " + path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

bool OnPath(const std::string& program) {
  const char* path = std::getenv("PATH");
  std::istringstream dirs(path ? path : "");
  std::string dir;
  while (std::getline(dirs, dir, ':'))
    if (!dir.empty() && ::access((fs::path(dir) / program).c_str(), X_OK) == 0) return true;
  return false;
}

}  // namespace

PilotKeys PreparePilotKeys(const std::string& keys_dir, const std::string& run_name,
                           bool coordinator_given) {
  const fs::path keys(keys_dir);
  MakePrivateDir(keys);
  PilotKeys out;
  // A `lorastream keygen` folder is the coordinator's folder and the user's client folder.
  const bool keygen_folder = fs::exists(keys / "coordinator.pub");
  const fs::path coord = keygen_folder ? keys : keys / "coordinator";
  out.coordinator_dir = coord.string();
  if (!fs::exists(coord / "coordinator.pub")) {
    if (coordinator_given)
      throw Error(ErrorCode::kNotFound,
                  keys_dir +
                      " holds no coordinator.pub: give --keys the folder of the "
                      "coordinator's keys (its `lorastream keygen --out` folder)");
    MakePrivateDir(coord);
    WriteKeyPair(coord, "coordinator");
    out.coordinator_created = true;
  }
  const fs::path client = keygen_folder && fs::exists(keys / "client.key") ? keys : keys / "client";
  out.client_dir = client.string();
  if (!fs::exists(client / "client.key")) {
    MakePrivateDir(client);
    CopyKey(coord / "coordinator.pub", client / "coordinator.pub");
    Admit(coord / "authorized_clients", WriteKeyPair(client, "client"),
          "lorastream slurm: the user's client key");
    out.client_created = true;
  }
  const fs::path workers = keys / "workers" / run_name;
  MakePrivateDir(keys / "workers");
  MakePrivateDir(workers);
  out.worker_dir = workers.string();
  CopyKey(coord / "coordinator.pub", workers / "coordinator.pub");
  Admit(coord / kWorkerAdmitList, WriteKeyPair(workers, kWorkerKeyStem),
        "lorastream slurm: the workers of " + run_name);
  return out;
}

std::string RenderPilotScript(const std::string& template_text, const SlurmOptions& options,
                              const PilotKeys& keys, const std::string& script_path) {
  const SlurmOptions o = Checked(options);
  const bool gpus = o.gpus_per_node > 0;
  const std::map<std::string, std::string> values = {
      {"SCRIPT", ShellQuote(script_path)},
      {"SBATCH", SbatchLines(o)},
      {"BIN", ShellQuote(o.bin_dir)},
      {"RUN_DIR", ShellQuote(o.run_dir)},
      {"COORDINATOR_KEYS", ShellQuote(keys.coordinator_dir)},
      {"WORKER_KEYS", ShellQuote(keys.worker_dir)},
      {"MODEL", o.model_dir.empty() ? "\"\"" : ShellQuote(o.model_dir)},
      {"STORE", ShellQuote(o.store)},
      {"COORDINATOR", o.coordinator.empty() ? "\"\"" : ShellQuote(o.coordinator)},
      {"PORT", std::to_string(o.port)},
      {"HEARTBEAT_TIMEOUT", Seconds(o.heartbeat_timeout_s)},
      {"WORKERS_PER_NODE", std::to_string(gpus ? o.gpus_per_node : o.cpu_workers_per_node)},
      {"WORKER_STEP",
       gpus ? "--gpus-per-task=1" + (o.cpus_per_task > 0
                                         ? " --cpus-per-task=" + std::to_string(o.cpus_per_task)
                                         : std::string())
            : "--cpus-per-task=" + std::to_string(CpuWorkerCpus(o))},
      {"WORKER_DEVICE", gpus ? "cuda:0" : "cpu"},
      // 0 is resolved by the script on each node (the CPUs Slurm allots, shared among the
      // node's workers): never every core for each of eight workers.
      {"WORKER_THREADS", std::to_string(o.worker_threads > 0 ? o.worker_threads : o.cpus_per_task)},
      {"WORKER_JOBS", std::to_string(o.jobs_per_gpu)},
      {"STORE_WAIT", Seconds(o.store_wait_s)},
  };
  std::string text;
  static const std::regex placeholder("@([A-Z_]+)@");
  size_t last = 0;
  for (auto it = std::sregex_iterator(template_text.begin(), template_text.end(), placeholder);
       it != std::sregex_iterator(); ++it) {
    auto value = values.find((*it)[1].str());
    if (value == values.end())
      throw Error(ErrorCode::kCorrupt,
                  "the pilot's template has a placeholder this build does not fill: " + it->str());
    text += template_text.substr(last, it->position() - last) + value->second;
    last = it->position() + it->length();
  }
  return text + template_text.substr(last);
}

int RunSlurm(SlurmOptions options, std::ostream& script_out, std::ostream& out) {
  const SlurmOptions o = Checked(std::move(options));
  const std::string template_path = o.configs_dir + "/slurm/pilot.sbatch.in";
  const std::string template_text = ReadTemplate(template_path);
  std::error_code ec;
  fs::create_directories(fs::path(o.run_dir) / "logs", ec);
  if (ec) throw Error(ErrorCode::kIo, "cannot create " + o.run_dir + "/logs: " + ec.message());
  const std::string run_name = fs::path(o.run_dir).filename().string();
  const PilotKeys keys = PreparePilotKeys(o.keys_dir, run_name, !o.coordinator.empty());
  const std::string script = o.run_dir + "/pilot.sbatch";
  {
    std::ofstream file(script, std::ios::trunc);
    file << RenderPilotScript(template_text, o, keys, script);
    if (!file.flush()) throw Error(ErrorCode::kIo, "cannot write " + script);
  }
  fs::permissions(script, fs::perms::owner_exec | fs::perms::group_exec | fs::perms::others_exec,
                  fs::perm_options::add, ec);
  if (o.print) script_out << ReadTemplate(script) << std::flush;
  const std::string endpoint =
      o.coordinator.empty() ? "$(cat " + o.run_dir + "/coordinator.endpoint)" : o.coordinator;
  out << "pilot script: " << script << "\n"
      << "  keys: the coordinator's " << keys.coordinator_dir
      << (keys.coordinator_created ? " (created)" : "") << ", this pilot's workers' "
      << keys.worker_dir << " (created), yours " << keys.client_dir
      << (keys.client_created ? " (created)" : "") << "\n";
  if (!o.coordinator.empty())
    out << "  the coordinator at " << o.coordinator
        << " reads its authorized_workers when it starts: restart it to admit this pilot's "
           "workers (its journal keeps every job)\n";
  out << "  jobs name the store: [model] store = \"" << o.store << "\"\n"
      << "  submit jobs: lorastream --coordinator " << endpoint << " --curve-keys "
      << keys.client_dir << " submit JOB.toml\n";
  if (!o.submit) {
    out << "  start it: sbatch " << script << "\n";
    return 0;
  }
  if (!OnPath("sbatch"))
    throw Error(ErrorCode::kNotFound, "sbatch is not on PATH: submit " + script +
                                          " with `sbatch` where Slurm's commands are");
  int code = -1;
  std::string id = RunAndCapture({"sbatch", "--parsable", script}, &code, 120);
  while (!id.empty() && (id.back() == '\n' || id.back() == '\r')) id.pop_back();
  if (code != 0)
    throw Error(ErrorCode::kRefused,
                "sbatch refused " + script + " (exit " + std::to_string(code) + ")");
  out << "  submitted: Slurm job " << id << "\n";
  return 0;
}

}  // namespace lorastream::cli
