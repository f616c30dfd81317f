// `lorastream slurm` without Slurm: the script it writes (every placeholder filled, valid bash,
// the steps of a GPU and of a CPU pilot), its keys (files in owner-only folders, secret keys
// 0600, none of them inside the script, each pilot's workers' key admitted apart, a second
// pilot reusing the coordinator's and the user's keys), and the options it refuses.
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

#include <catch2/catch.hpp>

#include "common/base/error.h"
#include "common/posix/shm_names.h"
#include "common/posix/subprocess.h"
#include "coordinator/cli/slurm.h"
#include "coordinator/client/curve.h"
#include "tests/support/test_support.h"

using namespace lorastream;
using namespace lorastream::cli;
namespace fs = std::filesystem;

namespace {

std::string ReadAll(const fs::path& path) {
  std::ifstream in(path);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

unsigned ModeOf(const fs::path& path) {
  struct stat st {};
  REQUIRE(::stat(path.c_str(), &st) == 0);
  return st.st_mode & 0777;
}

// A model folder as far as the command looks (config.json), and options naming it.
SlurmOptions Options(const testing::TempDir& dir) {
  fs::create_directories(dir.path() / "models" / "Qwen3-8B");
  std::ofstream(dir.path() / "models" / "Qwen3-8B" / "config.json") << "{}\n";
  SlurmOptions o;
  o.model_dir = dir / "models/Qwen3-8B";
  o.nodes = 2;
  o.gpus_per_node = 8;
  o.partition = "gpu";
  o.time = "1-00:00:00";
  o.account = "lab";
  o.sbatch_lines = {"--constraint=h200", "#SBATCH --exclusive"};
  o.keys_dir = dir / "keys";
  o.run_dir = dir / "run";
  o.bin_dir = "/opt/lorastream/bin";
  o.configs_dir = LORASTREAM_SOURCE_DIR "/configs";
  return o;
}

std::string Render(const SlurmOptions& o) {
  std::ostringstream out;
  REQUIRE(RunSlurm(o, out) == 0);
  return ReadAll(fs::path(o.run_dir) / "pilot.sbatch");
}

}  // namespace

TEST_CASE("slurm: a GPU pilot's script, every step and setting in it, valid bash",
          "[coordinator][slurm]") {
  const testing::TempDir dir("slurm-script");
  const SlurmOptions o = Options(dir);
  std::ostringstream said;
  REQUIRE(RunSlurm(o, said) == 0);
  const std::string script = ReadAll(dir / "run/pilot.sbatch");
  INFO(script);
  CHECK(!std::regex_search(script, std::regex("@[A-Z_]+@")));  // every placeholder filled
  const std::vector<std::string> expected = {
      "#SBATCH --nodes=2",
      "#SBATCH --ntasks-per-node=8",
      "#SBATCH --gpus-per-node=8",
      "#SBATCH --no-kill",
      "#SBATCH --no-requeue",
      "#SBATCH --partition=gpu",
      "#SBATCH --time=1-00:00:00",
      "#SBATCH --account=lab",
      "#SBATCH --constraint=h200",
      "#SBATCH --exclusive",
      "#SBATCH --output=" + dir / "run/logs/pilot-%j.out",
      "MODEL=" + dir / "models/Qwen3-8B",
      "STORE=Qwen3-8B",
      "COORDINATOR=\"\"",
      "BIN=/opt/lorastream/bin",
      "WORKER_STEP=(--gpus-per-task=1)",
      "WORKER_DEVICE=cuda:0",
      "WORKER_KEYS=" + dir / "keys/workers/run",
      "COORDINATOR_KEYS=" + dir / "keys/coordinator",
      "srun --overlap --ntasks-per-node=1 -n\"$SLURM_NNODES\"",
      "--db \"$RUN_DIR/journal.db\""};
  for (const std::string& line : expected) CHECK(script.find(line) != std::string::npos);
  // The #SBATCH lines come before the first command (sbatch reads no further).
  CHECK(script.find("#SBATCH") < script.find("\nset -euo pipefail"));
  CHECK(script.rfind("#SBATCH") < script.find("\nset -euo pipefail"));
  int code = -1;
  RunAndCapture({"bash", "-n", (dir / "run/pilot.sbatch")}, &code, 30);
  CHECK(code == 0);
  CHECK(said.str().find("[model] store = \"Qwen3-8B\"") != std::string::npos);

  // Keys: files in owner-only folders, never inside the script.
  for (const char* sub : {"keys", "keys/coordinator", "keys/client", "keys/workers/run"})
    CHECK(ModeOf(dir / sub) == 0700);
  for (const char* key : {"keys/coordinator/coordinator.key", "keys/client/client.key",
                          "keys/workers/run/worker.key"}) {
    CHECK(ModeOf(dir / key) == 0600);
    const std::string secret = ReadAll(dir / key).substr(0, 40);
    CHECK(script.find(secret) == std::string::npos);
  }
  // What the coordinator, the workers and the user load from them.
  const client::CurveServerKeys server = client::LoadServerKeys(dir / "keys/coordinator");
  const client::CurveClientKeys worker = client::LoadClientKeys(dir / "keys/workers/run", "worker");
  const client::CurveClientKeys user = client::LoadClientKeys(dir / "keys/client");
  CHECK(worker.server_public_key == server.server.public_key);
  CHECK(server.authorized_workers.count(worker.client.public_key) == 1);
  CHECK(server.authorized_clients.count(worker.client.public_key) == 0);
  CHECK(server.authorized_clients.count(user.client.public_key) == 1);
  CHECK(worker.client.public_key != user.client.public_key);
}

TEST_CASE("slurm: a second pilot reuses the coordinator's and the user's keys, its workers' own",
          "[coordinator][slurm]") {
  const testing::TempDir dir("slurm-keys");
  SlurmOptions o = Options(dir);
  Render(o);
  const std::string coordinator_key = ReadAll(dir / "keys/coordinator/coordinator.key");
  const std::string client_key = ReadAll(dir / "keys/client/client.key");
  o.run_dir = dir / "second";
  o.coordinator = "tcp://head.cluster:47813";
  const std::string script = Render(o);
  CHECK(script.find("COORDINATOR=tcp://head.cluster:47813") != std::string::npos);
  CHECK(ReadAll(dir / "keys/coordinator/coordinator.key") == coordinator_key);
  CHECK(ReadAll(dir / "keys/client/client.key") == client_key);
  const client::CurveServerKeys server = client::LoadServerKeys(dir / "keys/coordinator");
  CHECK(server.authorized_clients.size() == 1);  // the user's
  CHECK(server.authorized_workers.size() == 2);  // two pilots' workers' keys
  for (const std::string run : {"run", "second"})
    CHECK(server.authorized_workers.count(
              client::LoadClientKeys(dir / ("keys/workers/" + run), "worker").client.public_key) ==
          1);
  // An existing coordinator's keys must be in --keys already.
  SlurmOptions elsewhere = Options(dir);
  elsewhere.keys_dir = dir / "other-keys";
  elsewhere.coordinator = "tcp://head.cluster:47813";
  std::ostringstream out;
  REQUIRE_THROWS_WITH(RunSlurm(elsewhere, out), Catch::Contains("holds no coordinator.pub"));
}

TEST_CASE("slurm: a CPU pilot on an existing store; a path with a quote stays one word",
          "[coordinator][slurm]") {
  const testing::TempDir dir("slurm-cpu");
  SlurmOptions o = Options(dir);
  o.model_dir.clear();
  o.store = "base";
  o.gpus_per_node = 0;
  o.cpu_workers_per_node = 2;
  o.worker_threads = 3;
  o.jobs_per_gpu = 2;
  o.bin_dir = dir / "it's here/bin";
  o.requeue = true;
  const std::string script = Render(o);
  INFO(script);
  for (const std::string& line : std::vector<std::string>{
           "#SBATCH --ntasks-per-node=2", "#SBATCH --cpus-per-task=3", "#SBATCH --requeue",
           "MODEL=\"\"", "STORE=base", "WORKER_STEP=(--cpus-per-task=3)", "WORKER_DEVICE=cpu",
           "WORKER_THREADS=3", "WORKER_JOBS=2", "BIN='" + dir / "it'\\''s here/bin'"})
    CHECK(script.find(line) != std::string::npos);
  CHECK(script.find("--gpus") == std::string::npos);
  // bash reads the settings back as they were given.
  int code = -1;
  const std::string bin =
      RunAndCapture({"bash", "-c", "eval \"$(grep '^BIN=' \"$0\")\"; printf %s \"$BIN\"",
                     dir / "run/pilot.sbatch"},
                    &code, 30);
  CHECK(code == 0);
  CHECK(bin == dir / "it's here/bin");
}

TEST_CASE("slurm: options that cannot make a pilot are refused, naming the option",
          "[coordinator][slurm]") {
  const testing::TempDir dir("slurm-bad");
  std::ostringstream out;
  auto refused = [&](const SlurmOptions& o, const std::string& why) {
    INFO(why);
    REQUIRE_THROWS_WITH(RunSlurm(o, out), Catch::Contains(why));
  };
  SlurmOptions both = Options(dir);
  both.cpu_workers_per_node = 2;
  refused(both, "exactly one of --gpus-per-node");
  SlurmOptions none = Options(dir);
  none.gpus_per_node = 0;
  refused(none, "exactly one of --gpus-per-node");
  SlurmOptions no_model = Options(dir);
  no_model.model_dir = dir / "missing";
  refused(no_model, "is not a model folder here (no config.json) nor a FLUX.1 checkpoint");
  SlurmOptions long_store = Options(dir);
  long_store.store = std::string(40, 's');
  refused(long_store, "longer than 32 characters");
  SlurmOptions bad_store = Options(dir);
  bad_store.store = "a.b";
  refused(bad_store, "store name `a.b`");
  SlurmOptions ipc = Options(dir);
  ipc.coordinator = "ipc:///tmp/c.sock";
  refused(ipc, "serves one host only");
  SlurmOptions two_lines = Options(dir);
  two_lines.partition = "gpu\n#SBATCH --qos=high";
  refused(two_lines, "--partition must be one line");
  SlurmOptions spaced = Options(dir);
  spaced.run_dir = dir / "my run";
  refused(spaced, "has a space in its path");
  SlurmOptions no_nodes = Options(dir);
  no_nodes.nodes = 0;
  refused(no_nodes, "--nodes must be at least 1");
  CHECK(!fs::exists(dir / "run/pilot.sbatch"));  // nothing written for a refused pilot
}

TEST_CASE("slurm: a FLUX.1 diffusers folder is served on every node as a model folder is",
          "[coordinator][slurm][flux]") {
  const testing::TempDir dir("slurm-flux");
  fs::create_directories(dir.path() / "models" / "FLUX.1-dev" / "transformer");
  std::ofstream(dir.path() / "models" / "FLUX.1-dev" / "transformer" / "config.json")
      << "{\"_class_name\": \"FluxTransformer2DModel\"}\n";
  SlurmOptions o = Options(dir);
  o.model_dir = dir / "models/FLUX.1-dev";
  const std::string script = Render(o);
  CHECK_THAT(script, Catch::Contains(o.model_dir));
  CHECK_THAT(script, Catch::Contains("FLUX_1-dev"));  // the store's name, from the folder's
}

TEST_CASE("store offers: NAME or AS=NAME, both names checked", "[coordinator][slurm]") {
  CHECK(ParseStoreOffer("base").name == "base");
  CHECK(ParseStoreOffer("base").offered_as == "base");
  const StoreOffer pilot = ParseStoreOffer("qwen=qwen-node7-1234");
  CHECK(pilot.offered_as == "qwen");
  CHECK(pilot.name == "qwen-node7-1234");
  REQUIRE_THROWS_WITH(ParseStoreOffer("qwen=node.7"), Catch::Contains("--store `qwen=node.7`"));
  REQUIRE_THROWS_WITH(ParseStoreOffer("=x"), Catch::Contains("store name ``"));
}

TEST_CASE("slurm --print: stdout is the script alone, what to do next goes to the other stream",
          "[coordinator][slurm]") {
  const testing::TempDir dir("slurm-print");
  SlurmOptions o = Options(dir);
  o.print = true;
  std::ostringstream script, notes;
  REQUIRE(RunSlurm(o, script, notes) == 0);
  CHECK(script.str() == ReadAll(dir / "run/pilot.sbatch"));  // `> pilot.sbatch` gives it whole
  CHECK(script.str().find("pilot script:") == std::string::npos);
  CHECK(notes.str().find("pilot script: " + dir / "run/pilot.sbatch") != std::string::npos);
}

TEST_CASE("slurm: --mem, --exclusive, --cpus-per-task; threads shared among a node's workers",
          "[coordinator][slurm]") {
  const testing::TempDir dir("slurm-cpus");
  SlurmOptions o = Options(dir);
  o.sbatch_lines.clear();
  o.mem = "500G";
  o.exclusive = true;
  o.cpus_per_task = 12;
  std::string script = Render(o);
  INFO(script);
  CHECK(script.find("#SBATCH --mem=500G") != std::string::npos);
  CHECK(script.find("#SBATCH --exclusive") != std::string::npos);
  CHECK(script.find("#SBATCH --cpus-per-task=12") != std::string::npos);
  CHECK(script.find("WORKER_STEP=(--gpus-per-task=1 --cpus-per-task=12)") != std::string::npos);
  CHECK(script.find("WORKER_THREADS=12\n") != std::string::npos);  // threads follow the CPUs
  int code = -1;
  RunAndCapture({"bash", "-n", (dir / "run/pilot.sbatch")}, &code, 30);
  CHECK(code == 0);

  // No --threads and no --cpus-per-task: the script shares the node's CPUs among its eight
  // workers (not every core for each).
  const testing::TempDir dir2("slurm-threads");
  script = Render(Options(dir2));
  CHECK(script.find("WORKER_THREADS=0\n") != std::string::npos);
  const std::string share =
      "WORKER_THREADS=$(( ${SLURM_CPUS_ON_NODE:-$(nproc)} / WORKERS_PER_NODE ))";
  REQUIRE(script.find(share) != std::string::npos);
  // What that line computes for 64 CPUs and eight workers.
  const std::string out = RunAndCapture(
      {"bash", "-c",
       "SLURM_CPUS_ON_NODE=64; WORKERS_PER_NODE=8; " + share + "; echo $WORKER_THREADS"},
      &code, 30);
  CHECK(out == "8\n");
}
