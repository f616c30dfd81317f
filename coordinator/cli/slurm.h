// `lorastream slurm`: the sbatch script of a pilot job that adds a Slurm allocation's nodes to
// a coordinator (one store per node, one worker per GPU, and a coordinator on the first node
// unless one is named), from the template configs/slurm/pilot.sbatch.in; with --submit, the
// job itself. The script is plain bash kept in the run's folder beside its logs, and works
// when submitted by hand; writing it needs no Slurm. Its CURVE keys are files in a folder the
// user names (PreparePilotKeys), never text inside the script.
#pragma once

#include <iosfwd>
#include <string>
#include <vector>

namespace lorastream::cli {

struct SlurmOptions {
  std::string model_dir;  // each node's store loads it ("": the nodes already run `store`)
  std::string store;      // the name jobs give as model.store ("": the model folder's name)
  int nodes = 1;
  int gpus_per_node = 0;         // one worker per GPU (--gpus-per-task=1) ...
  int cpu_workers_per_node = 0;  // ... or this many CPU workers: exactly one of the two
  int worker_threads = 0;        // CPU threads per worker (0: --cpus-per-task, else the node's CPUs
                                 // that Slurm allots shared among its workers)
  int cpus_per_task = 0;         // CPUs Slurm allots each worker (0: Slurm's default; a CPU worker
                                 // gets max(1, worker_threads))
  std::string mem;         // #SBATCH --mem (memory per node, e.g. "500G"; "": Slurm's default)
  bool exclusive = false;  // #SBATCH --exclusive: the nodes are the pilot's alone
  int jobs_per_gpu = 0;    // each worker's job slots, `serve --jobs` (0: its default)
  std::string partition, time, account, job_name = "lorastream";
  std::vector<std::string> sbatch_lines;  // more #SBATCH lines, e.g. "--constraint=h200"
  bool requeue = false;                   // Slurm restarts the pilot when its first node fails
  std::string coordinator;         // an existing coordinator's tcp:// endpoint ("": start one)
  int port = 47813;                // where a coordinator started by the pilot listens
  double heartbeat_timeout_s = 0;  // of that coordinator (0: the coordinator's default)
  double store_wait_s = 3600;      // how long a worker waits for its node's store to load
  std::string keys_dir;            // the user's CURVE keys folder, on shared storage
  std::string run_dir;             // "" = runs/slurm-DATE-TIME; on shared storage
  std::string bin_dir;             // "" = the folder of the running `lorastream`
  std::string configs_dir;         // "" = ConfigsDir()
  bool submit = false;             // run sbatch on the script
  bool print = false;              // print the script
};

// Where a pilot's keys are: folders holding key files, each 0700 with secret keys 0600.
struct PilotKeys {
  std::string coordinator_dir;  // the coordinator's: coordinator.{pub,key}, authorized_clients
  std::string worker_dir;       // this pilot's workers' key pair and coordinator.pub
  std::string client_dir;       // the user's own key for submit, watch, cancel
  bool coordinator_created = false;
  bool client_created = false;
};

// Creates what `keys_dir` lacks and uses what it has: the coordinator's key pair (in
// KEYS/coordinator/, or KEYS itself when it is a `lorastream keygen` folder), the user's client
// key (KEYS/client/, or the keygen folder's client.*), and a fresh key pair for this pilot's
// workers (KEYS/workers/RUN_NAME/), admitted in the coordinator's authorized_clients with a
// comment naming the run. With an existing coordinator (`coordinator_given`) its coordinator.pub
// must be there already. Error(kRefused) when a folder belongs to another user.
PilotKeys PreparePilotKeys(const std::string& keys_dir, const std::string& run_name,
                           bool coordinator_given);

// The script: `template_text` with its @NAME@ placeholders filled from `options` (checked, with
// absolute paths), `keys` and the script's own path. Throws Error(kInvalidArgument) naming
// the option at fault.
std::string RenderPilotScript(const std::string& template_text, const SlurmOptions& options,
                              const PilotKeys& keys, const std::string& script_path);

// Checks the options, prepares the keys, writes RUN_DIR/pilot.sbatch, prints the script on
// `out` with `print`, what to do next on `notes` (so that `--print > pilot.sbatch` leaves only
// the script in the file), submits it with `submit`. Returns the exit status.
int RunSlurm(SlurmOptions options, std::ostream& out, std::ostream& notes);
inline int RunSlurm(SlurmOptions options, std::ostream& out) {
  return RunSlurm(std::move(options), out, out);
}

}  // namespace lorastream::cli
