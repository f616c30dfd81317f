#include "coordinator/cli/cli.h"

#include <sys/ioctl.h>
#include <unistd.h>

#include <atomic>
#include <charconv>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <limits>
#include <memory>
#include <sstream>
#include <vector>

#include <CLI/CLI.hpp>

#include "common/base/cli_main.h"
#include "common/base/error.h"
#include "common/base/log.h"
#include "common/base/terminal_text.h"
#include "common/formats/checkpoint_dir.h"
#include "common/formats/manifest.h"
#include "common/formats/manifest_tokenizer.h"
#include "common/formats/tokenizer_id.h"
#include "common/job/adapter_consumers.h"
#include "common/job/flux_job.h"
#include "common/job/job_data.h"
#include "common/job/job_kind.h"
#include "common/job/job_paths.h"
#include "common/job/job_spec.h"
#include "coordinator/cli/cli_format.h"
#include "coordinator/cli/doctor.h"
#include "coordinator/cli/down.h"
#include "coordinator/cli/prepare.h"
#include "coordinator/cli/slurm.h"
#include "coordinator/cli/up.h"
#include "coordinator/cli/watch_view.h"
#include "coordinator/client/client.h"
#include "coordinator/client/curve.h"
#include "coordinator/daemon/coordinator_server.h"
#include "coordinator/daemon/tensorboard.h"
#include "store/manifest_object.h"

namespace lorastream::cli {
namespace {

std::atomic<bool> g_stop{false};
void OnSignal(int) { g_stop = true; }

struct GlobalOptions {
  std::string endpoint = client::DefaultEndpoint();
  std::string curve_keys;
  double timeout_s = 10;
  CLI::Option* timeout_given = nullptr;   // count() > 0 when --timeout was given
  CLI::Option* endpoint_given = nullptr;  // count() > 0 when --coordinator was given
};

client::Client Connect(const GlobalOptions& g) {
  // A missing ipc socket file means no coordinator: say so at once rather than wait for a reply
  // (the folder's own problems are the client's to name, before it connects).
  if (g.endpoint.rfind("ipc://", 0) == 0 && client::EndpointDirProblem(g.endpoint).empty()) {
    const std::string path = g.endpoint.substr(6);
    std::error_code ec;
    if (!std::filesystem::exists(path, ec) && !ec)
      throw Error(ErrorCode::kNotFound,
                  "no coordinator at " + g.endpoint + ": the socket file " + path +
                      " does not exist (start one: `lorastream coordinator`, or `lorastream up "
                      "--detach`; or point --coordinator / LORASTREAM_COORDINATOR at yours)");
  }
  return client::Client(
      client::ClientOptions{g.endpoint, g.curve_keys, static_cast<int>(g.timeout_s * 1000)});
}

int RunCoordinator(const GlobalOptions& g, coordinator::ServerOptions options,
                   const std::string& log_level, const std::string& log_file,
                   const std::string& tensorboard_dir) {
  InitLogging("coordinator", log_level, log_file);
  options.curve_keys_dir = g.curve_keys;
  options.coordinator.validator = [](const JobSpec& spec) {
    return ValidateJobSpec(spec, nullptr);
  };
  if (!tensorboard_dir.empty()) {
    auto writer = std::make_shared<coordinator::TensorBoardWriter>(tensorboard_dir);
    LS_LOG_INFO("tensorboard: one run per job under {}", writer->dir());
    options.coordinator.on_stats = [writer](const JobSummary& job, const StepStats& stats) {
      writer->Write(job, stats);
    };
  }
  coordinator::CoordinatorServer server(options);
  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  std::signal(SIGPIPE, SIG_IGN);
  server.Run(g_stop);
  return 0;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(ErrorCode::kNotFound, "cannot read job file " + path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// What is wrong with the job's store when it is on this host: a store of the other model
// family (FLUX.1 or an LLM), or data prepared for another tokenizer than the store's.
std::string StoreProblem(const JobSpec& spec) {
  if (spec.model.store.empty()) return "";
  std::optional<store::ManifestRecord> record;
  try {
    record = store::ReadManifestObject(spec.model.store);
  } catch (const Error&) {
    return "";  // another user's store, unreadable to us: the worker checks
  }
  if (!record || record->json.empty())
    return "";  // not here or not yet published: the worker checks
  const Manifest m = ManifestFromJson(record->json, "store `" + spec.model.store + "`");
  if (JobFamily(spec) != m.model_family())
    return spec.source + ": key `" +
           (spec.is_flux ? FluxKeyName(spec.flux, "store") : "model.store") + "`: store `" +
           spec.model.store + "` serves " + m.family() +
           (spec.is_flux ? ", not FLUX.1 (serve a FLUX checkpoint: lorastream-store serve PATH)"
            : spec.is_qwen_image
                ? ", not Qwen-Image (serve a Qwen-Image checkpoint: lorastream-store serve PATH)"
                : "; an LLM job names an LLM's store (a FLUX job has a [flux] section, a "
                  "Qwen-Image job a [qwen_image] section)");
  if (spec.is_flux || spec.is_qwen_image) return "";
  return DataTokenizerProblem(
      spec.data.path, spec.data.format, [&] { return ManifestTokenizer(m); },
      "store `" + spec.model.store + "`", m.config.vocab_size);
}

// For a job by epochs: the data's sequences and the steps they make, as the worker will
// compute them ("" when the data cannot be read here; the worker then says it).
std::string DescribeSteps(const JobSpec& spec) {
  if (spec.train.epochs <= 0) return "";
  try {
    // The model's vocabulary is not known here: ids are checked by the worker.
    return DescribeJobData(spec, LoadJobData(spec, std::numeric_limits<int32_t>::max()));
  } catch (const std::exception& e) {
    return std::string("steps: computed by the worker (the data is not readable here: ") +
           e.what() + ")";
  }
}

// The checkpoint with the lowest eval loss kept by the trainer's retention (train.keep_best),
// read from the checkpoints' own trainer states; "" when there is none or it cannot be read
// from this host.
std::string BestCheckpoint(const std::string& output_dir) {
  if (output_dir.empty()) return "";
  try {
    return FindBestCheckpoint(output_dir);
  } catch (const std::exception&) {
    return "";
  }
}

int RunSubmit(const GlobalOptions& g, const std::string& path, int64_t* priority, bool json,
              bool quiet) {
  SubmitRequest req;
  req.spec_toml = ReadFile(path);
  // Parsed and resolved here: the file's path is relative to where the user typed it, the
  // paths inside it to the file's own folder.
  std::string source = std::filesystem::absolute(path).lexically_normal().string();
  req.spec = ParseJobSpec(req.spec_toml, source);
  ResolveJobSpecIn(req.spec, JobFileDir(source));
  if (priority) req.spec.priority = *priority;
  // What the adapter's consumers require (vLLM's ranks, llama.cpp's scale): warnings only.
  if (!quiet)
    for (const std::string& w : AdapterConsumerWarnings(req.spec))
      std::cerr << "lorastream submit: warning: " << w << "\n";
  // A name or a file too long to send (refused here, before a request over the message size
  // limit would hide why); data prepared for another tokenizer than the store's, when the
  // store is on this host (a checkpoint's tokenizer is checked by ValidateJobSpec, in the
  // coordinator).
  std::string why = JobNameProblem(req.spec);
  if (why.empty() && req.spec_toml.size() > kMaxJobFileBytes)
    why = path + " is " + std::to_string(req.spec_toml.size()) + " bytes, above the limit of " +
          std::to_string(kMaxJobFileBytes) + " bytes for a job file";
  if (why.empty()) why = StoreProblem(req.spec);
  if (!why.empty()) {
    if (json)
      std::cout
          << nlohmann::json{{"job_id", nullptr}, {"problems", nlohmann::json::array({why})}}.dump(2)
          << "\n";
    std::cerr << "lorastream submit: " << path << " was refused (1 problem):\n  " << why << "\n";
    return ExitCodeFor(ErrorCode::kRefused);
  }
  client::Client client = Connect(g);
  SubmitReply reply = client.Call(req);
  if (!reply.problems.empty()) {
    if (json) {
      std::cout << nlohmann::json{{"job_id", nullptr}, {"problems", reply.problems}}.dump(2)
                << "\n";
    }
    std::cerr << "lorastream submit: " << path << " was refused (" << reply.problems.size()
              << (reply.problems.size() == 1 ? " problem" : " problems") << "):\n";
    for (const std::string& p : reply.problems) std::cerr << "  " << p << "\n";
    return ExitCodeFor(ErrorCode::kRefused);
  }
  if (json) {
    std::cout
        << nlohmann::json{{"job_id", reply.job_id}, {"problems", nlohmann::json::array()}}.dump(2)
        << "\n";
  } else if (quiet) {
    std::cout << reply.job_id << "\n";
  } else {
    std::cout << "job " << reply.job_id << " submitted: " << TerminalSafe(req.spec.name) << "\n";
    const std::string steps = DescribeSteps(req.spec);
    if (!steps.empty()) std::cout << "  " << steps << "\n";
  }
  return 0;
}

int RunStats(const GlobalOptions& g, int64_t job, const std::string& format) {
  client::Client client = Connect(g);
  StatsReply reply = client.Call(StatsRequest{job});
  std::cout << (format == "json" ? StatsJson(job, reply.stats) : StatsCsv(reply.stats));
  return 0;
}

// --- output of the verbs that only ask the coordinator --------------------------------------

// A listing: its table, or with --json an array of each item's ToJson.
template <class Item, class Table>
void PrintList(const std::vector<Item>& items, bool json, const Table& table) {
  if (!json) {
    std::cout << table(items);
    return;
  }
  nlohmann::json out = nlohmann::json::array();
  for (const Item& item : items) out.push_back(ToJson(item));
  std::cout << out.dump(2) << "\n";
}

void PrintJob(const ShowJobReply& reply, const std::string& best_checkpoint, bool json) {
  // train.keep_best: the best checkpoint's adapter at its stable path (OUTPUT_DIR/best/).
  const std::string best_adapter =
      reply.job.output_dir.empty() ? "" : BestAdapterDir(reply.job.output_dir);
  if (!json) {
    std::cout << JobDetails(reply, best_checkpoint, best_adapter);
    return;
  }
  nlohmann::json out = ToJson(reply.job);
  out["retries"] = reply.retries;
  out["spec_toml"] = reply.spec_toml;
  out["best_checkpoint"] =
      best_checkpoint.empty() ? nlohmann::json(nullptr) : nlohmann::json(best_checkpoint);
  out["best_adapter"] =
      best_adapter.empty() ? nlohmann::json(nullptr) : nlohmann::json(best_adapter);
  std::cout << out.dump(2) << "\n";
}

void PrintCancel(int64_t job_id, const CancelReply& reply, bool json) {
  if (json)
    std::cout << nlohmann::json{{"job_id", job_id}, {"state", JobStateName(reply.state)}}.dump()
              << "\n";
  else if (reply.state == JobState::kCancelled)
    std::cout << "job " << job_id << " cancelled\n";
  else
    std::cout << "job " << job_id
              << ": cancel requested; it stops at its next step "
                 "boundary after saving its adapter\n";
}

// --- the verbs: each adds its subcommand with its flags and says what running it does --------

// A verb's subcommand and its run, which reads the options the subcommand's flags were parsed
// into (held by the run itself).
struct Verb {
  CLI::App* command = nullptr;
  std::function<int()> run;
};

// Checked as text, before CLI11 converts it: strtoll would saturate 2^64-1 to 2^63-1 and the
// command would then talk about a job the user never named.
CLI::Validator JobIdCheck() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        int64_t id = 0;
        const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), id);
        if (text.empty() || ec != std::errc() || end != text.data() + text.size() || id < 1)
          return "a job id is a whole number in [1, 9223372036854775807] (found " +
                 TerminalSafe(text) + ")";
        return "";
      },
      "JOB ID");
}

Verb CoordinatorVerb(CLI::App& app, const GlobalOptions& g) {
  struct Options {
    coordinator::ServerOptions server;
    std::string log_level = "info", log_file, tensorboard_dir;
  };
  auto o = std::make_shared<Options>();
  CLI::App* coord = app.add_subcommand("coordinator", "run the coordinator daemon");
  coord
      ->add_option("--bind", o->server.bind,
                   "endpoint to listen on (tcp:// needs "
                   "--curve-keys or --insecure)")
      ->capture_default_str();
  coord->add_option("--db", o->server.db, "SQLite journal (created when missing)")
      ->capture_default_str();
  coord
      ->add_option("--heartbeat-timeout", o->server.coordinator.heartbeat_timeout_s,
                   "seconds of silence after which a worker is dead")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  coord
      ->add_option("--heartbeat-interval", o->server.coordinator.heartbeat_interval_s,
                   "seconds between worker heartbeats (told to workers)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  coord
      ->add_option("--max-retries", o->server.coordinator.max_retries,
                   "requeues after worker deaths before a job fails")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  coord->add_option("--reconcile-timeout", o->server.coordinator.reconcile_timeout_s,
                    "after a restart, seconds running jobs wait for their workers "
                    "(default: the heartbeat timeout)");
  coord->add_flag(
      "--insecure", o->server.insecure,
      "allow a tcp:// bind without CURVE (anyone who can reach it acts as the operator)");
  coord->add_option("--log-level", o->log_level, "trace|debug|info|warn|error")
      ->capture_default_str();
  coord->add_option("--log-file", o->log_file, "also log to this file");
  coord->add_option("--tensorboard", o->tensorboard_dir,
                    "write TensorBoard event files here, one run per job (job-ID-NAME/)");
  return {coord, [o, &g] {
            return RunCoordinator(g, o->server, o->log_level, o->log_file, o->tensorboard_dir);
          }};
}

Verb SubmitVerb(CLI::App& app, const GlobalOptions& g) {
  struct Options {
    std::string job_file;
    int64_t priority = 0;
    CLI::Option* priority_given = nullptr;
    bool json = false, quiet = false;
  };
  auto o = std::make_shared<Options>();
  CLI::App* submit = app.add_subcommand("submit", "validate a job file and queue it");
  submit->add_option("JOB_TOML", o->job_file, "the job file")->required();
  o->priority_given =
      submit->add_option("--priority", o->priority, "override the file's priority (higher first)");
  submit->add_flag("--json", o->json, "print {job_id, problems} as JSON");
  submit->add_flag("-q,--quiet", o->quiet, "print only the job id");
  return {submit, [o, &g] {
            return RunSubmit(g, o->job_file, o->priority_given->count() ? &o->priority : nullptr,
                             o->json, o->quiet);
          }};
}

Verb JobsVerb(CLI::App& app, const GlobalOptions& g) {
  struct Options {
    bool json = false, active_only = false;
  };
  auto o = std::make_shared<Options>();
  CLI::App* jobs = app.add_subcommand("jobs", "list jobs");
  jobs->add_flag("--json", o->json, "JSON array");
  jobs->add_flag("--active", o->active_only, "only queued and running jobs");
  return {jobs, [o, &g] {
            client::Client client = Connect(g);
            const ListJobsReply reply = client.Call(ListJobsRequest{!o->active_only});
            PrintList(reply.jobs, o->json, JobsTable);
            return 0;
          }};
}

Verb ShowVerb(CLI::App& app, const GlobalOptions& g) {
  struct Options {
    int64_t job_id = 0;
    bool json = false;
  };
  auto o = std::make_shared<Options>();
  CLI::App* show = app.add_subcommand("show", "a job's state, progress, worker and job file");
  show->add_option("JOB", o->job_id, "job id")->required()->check(JobIdCheck());
  show->add_flag("--json", o->json, "JSON object");
  return {show, [o, &g] {
            client::Client client = Connect(g);
            const ShowJobReply reply = client.Call(ShowJobRequest{o->job_id});
            PrintJob(reply, BestCheckpoint(reply.job.output_dir), o->json);
            return 0;
          }};
}

Verb StatsVerb(CLI::App& app, const GlobalOptions& g) {
  struct Options {
    int64_t job_id = 0;
    std::string format = "csv";
  };
  auto o = std::make_shared<Options>();
  CLI::App* stats = app.add_subcommand("stats", "a job's per-step statistics (downsampled)");
  stats->add_option("JOB", o->job_id, "job id")->required()->check(JobIdCheck());
  stats->add_option("--format", o->format, "csv or json")
      ->check(CLI::IsMember({"csv", "json"}))
      ->capture_default_str();
  return {stats, [o, &g] { return RunStats(g, o->job_id, o->format); }};
}

Verb CancelVerb(CLI::App& app, const GlobalOptions& g) {
  struct Options {
    int64_t job_id = 0;
    bool json = false;
  };
  auto o = std::make_shared<Options>();
  CLI::App* cancel = app.add_subcommand(
      "cancel", "cancel a job (a running one stops at its next step boundary, adapter saved)");
  cancel->add_option("JOB", o->job_id, "job id")->required()->check(JobIdCheck());
  cancel->add_flag("--json", o->json, "JSON object");
  return {cancel, [o, &g] {
            client::Client client = Connect(g);
            PrintCancel(o->job_id, client.Call(CancelRequest{o->job_id}), o->json);
            return 0;
          }};
}

Verb WorkersVerb(CLI::App& app, const GlobalOptions& g) {
  struct Options {
    bool json = false, include_dead = false;
  };
  auto o = std::make_shared<Options>();
  CLI::App* workers = app.add_subcommand("workers", "list registered workers");
  workers->add_flag("--json", o->json, "JSON array");
  workers->add_flag("--all", o->include_dead, "include dead workers");
  return {workers, [o, &g] {
            client::Client client = Connect(g);
            const ListWorkersReply reply = client.Call(ListWorkersRequest{o->include_dead});
            PrintList(reply.workers, o->json, WorkersTable);
            return 0;
          }};
}

Verb WatchVerb(CLI::App& app, const GlobalOptions& g) {
  struct Options {
    WatchOptions watch;
    bool plain = false;
  };
  auto o = std::make_shared<Options>();
  CLI::App* watch = app.add_subcommand(
      "watch", "live view until the watched jobs end (exit 1 if one failed or was cancelled)");
  watch->add_option("JOB", o->watch.job_ids, "job ids (default: every job not yet ended)")
      ->check(JobIdCheck());
  watch->add_flag("--plain", o->plain, "plain lines even on a terminal");
  watch
      ->add_option("--line-interval", o->watch.line_interval_s,
                   "plain mode: seconds between progress lines of one job")
      ->capture_default_str();
  return {watch, [o, &g] {
            client::Client client = Connect(g);
            WatchOptions options = o->watch;
            options.tty = !o->plain && isatty(STDOUT_FILENO);
            winsize size{};
            if (options.tty && ioctl(STDOUT_FILENO, TIOCGWINSZ, &size) == 0 && size.ws_col > 0)
              options.width = size.ws_col;
            return RunWatch(client, options, std::cout);
          }};
}

Verb PrepareVerb(CLI::App& app) {
  auto o = std::make_shared<PrepareOptions>();
  CLI::App* prepare = app.add_subcommand(
      "prepare",
      "a user's text or conversations -> training data, with the model folder's own "
      "tokenizer and chat template (ids as Python transformers makes them)");
  prepare
      ->add_option("--model", o->model_dir,
                   "model folder with tokenizer.json, tokenizer_config.json (and its chat "
                   "template)")
      ->required();
  prepare
      ->add_option("--in", o->inputs,
                   "input file(s): .jsonl (one record a line), .json (an array), .txt (text: "
                   "one document a line)")
      ->required();
  prepare
      ->add_option("--format", o->format,
                   "text {\"text\"} | alpaca {\"instruction\", \"input\", \"output\"} | "
                   "sharegpt {\"conversations\": [{\"from\", \"value\"}]} | messages "
                   "{\"messages\": [{\"role\", \"content\"}]}")
      ->required()
      ->check(CLI::IsMember({"text", "alpaca", "sharegpt", "messages"}));
  prepare->add_option("--out", o->out, "the data: .jsonl, or .tok/.bin (the compact token file)")
      ->required();
  prepare
      ->add_option("--val-split", o->val_split,
                   "fraction of the documents held out into OUT with .val before the "
                   "extension (e.g. 0.02)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 0.9));
  prepare
      ->add_option("--seq-len", o->seq_len,
                   "truncate longer documents to this many tokens (0 = keep them whole)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 31));
  prepare->add_flag("--train-on-all", o->train_on_all,
                    "train on every token (default: only the assistant turns of conversations)");
  prepare->add_option("--seed", o->seed, "the validation split's draw")
      ->capture_default_str()
      ->check(CLI::Range(uint64_t{0}, uint64_t{4294967295}));
  prepare->add_flag("--force", o->force,
                    "replace OUT (and its .val file) when it exists or is one of the inputs");
  return {prepare, [o] { return RunPrepare(*o); }};
}

Verb KeygenVerb(CLI::App& app) {
  struct Options {
    std::string key_dir;
    bool force = false;
  };
  auto o = std::make_shared<Options>();
  CLI::App* keygen = app.add_subcommand(
      "keygen", "write CURVE keys for the coordinator, its clients and its workers");
  keygen->add_option("--out", o->key_dir, "folder to write the keys into")->required();
  keygen->add_flag("--force", o->force, "replace existing keys");
  return {keygen, [o] {
            client::WriteCurveKeys(o->key_dir, o->force);
            std::cout << "CURVE keys written to " << o->key_dir << "\n  coordinator: lorastream "
                      << "coordinator --curve-keys " << o->key_dir << " --bind tcp://0.0.0.0:PORT\n"
                      << "  clients: --curve-keys DIR, where DIR holds copies of "
                         "coordinator.pub, client.pub and client.key\n"
                      << "  workers: --curve-keys DIR, where DIR holds copies of "
                         "coordinator.pub, worker.pub and worker.key (never coordinator.key)\n"
                      << "  authorized_clients: the client keys the coordinator admits, one a "
                         "line; `KEY alice` maps a key to the local user alice (its jobs run as "
                         "alice), a bare key is the operator (the coordinator's user: every job)\n"
                      << "  authorized_workers: the keys that may register as workers; add a "
                         "line per worker key pair you make. Both are read when the "
                         "coordinator starts\n";
            return 0;
          }};
}

Verb UpVerb(CLI::App& app) {
  struct Options {
    UpOptions up;
    bool no_watch = false;
  };
  auto o = std::make_shared<Options>();
  CLI::App* up = app.add_subcommand(
      "up",
      "start a store, workers (one per GPU, else CPU workers) and a coordinator, submit "
      "the example jobs, watch them to the end, print the adapters, stop everything");
  up->add_option("--model", o->up.model_dir,
                 "Hugging Face checkpoint folder, FLUX.1's (BFL's flux1-dev.safetensors, a "
                 "folder holding it, or a diffusers folder: FLUX jobs are submitted) or "
                 "Qwen-Image's (ComfyUI's qwen_image_bf16.safetensors or a diffusers folder: "
                 "its --job files are submitted) (default: synthesize --preset)");
  CLI::Option* preset = up->add_option("--preset", o->up.preset,
                                       "configs/models preset to synthesize (default: tiny, "
                                       "flux-tiny for FLUX jobs, qwen-image-tiny for Qwen-Image "
                                       "jobs)");
  up->add_option("--job", o->up.jobs,
                 "job file(s) to submit (default: the configs/jobs/*.toml of the model's family); "
                 "without --model, the base they name (or their family's tiny preset) is served");
  up->add_option("--run-dir", o->up.run_dir,
                 "folder for logs, model, jobs, adapters (default: runs/up-DATE-TIME)");
  up->add_option("--device", o->up.devices,
                 "worker device(s), e.g. cuda:0 or cpu "
                 "(default: every GPU, else --cpu-workers)");
  up->add_option("--cpu-workers", o->up.cpu_workers, "CPU workers when there is no GPU")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  up->add_option("--jobs-per-gpu", o->up.jobs_per_worker,
                 "jobs each worker trains at once as one job group (`serve --jobs`; default: "
                 "the worker's, from its GPU's memory, 1 on the CPU)")
      ->check(CLI::Range(1, 64));
  CLI::Option* keep = up->add_flag("--keep", o->up.keep, "leave the cluster running at the end");
  up->add_flag("--detach", o->up.detach,
               "return once the jobs are submitted, the cluster running (`lorastream down` "
               "stops it)")
      ->excludes(keep);
  up->add_flag("--no-watch", o->no_watch, "no live view; wait quietly for the jobs");
  up->add_option("--tensorboard", o->up.tensorboard_dir,
                 "the coordinator writes TensorBoard event files here, one run per job");
  return {up, [o, preset] {
            UpOptions options = o->up;
            options.watch = !o->no_watch;
            options.preset_given = preset->count() > 0;
            return RunUp(options);
          }};
}

Verb DownVerb(CLI::App& app) {
  auto run_dir = std::make_shared<std::string>();
  CLI::App* down = app.add_subcommand(
      "down",
      "stop a cluster that `lorastream up --detach` (or --keep) left running: its workers, "
      "coordinator and store");
  down->add_option("RUN_DIR", *run_dir,
                   "the cluster's run folder (default: the one cluster recorded for this user)");
  return {down, [run_dir] { return RunDown(*run_dir, 30, std::cout); }};
}

Verb SlurmVerb(CLI::App& app) {
  auto o = std::make_shared<SlurmOptions>();
  CLI::App* slurm = app.add_subcommand(
      "slurm",
      "write (and with --submit submit) the sbatch script of a pilot job that adds Slurm "
      "nodes to a coordinator: a store per node, a worker per GPU, and a coordinator on the "
      "first node unless --coordinator names one. The script, its logs and the journal go "
      "into --run-dir, the CURVE keys into --keys (both on storage every node sees)");
  slurm->add_option("--model", o->model_dir,
                    "model folder each node's store loads (the same path on every node)");
  slurm->add_option("--store", o->store,
                    "the store name jobs give (model.store; default: the model folder's name); "
                    "without --model, a store of that name already runs on every node");
  slurm->add_option("--nodes,-N", o->nodes, "nodes")->capture_default_str();
  slurm->add_option("--gpus-per-node", o->gpus_per_node, "GPUs per node: one worker each");
  slurm->add_option("--cpu-workers-per-node", o->cpu_workers_per_node,
                    "or CPU workers per node (no GPUs)");
  slurm
      ->add_option("--threads", o->worker_threads,
                   "CPU threads per worker (0: --cpus-per-task, else the node's CPUs shared "
                   "among its workers)")
      ->capture_default_str();
  slurm->add_option("--cpus-per-task", o->cpus_per_task,
                    "CPUs Slurm allots each worker (default: Slurm's; CPU workers: --threads)");
  slurm->add_option("--mem", o->mem, "memory per node, e.g. 500G (#SBATCH --mem)");
  slurm->add_flag("--exclusive", o->exclusive, "the nodes are the pilot's alone");
  slurm
      ->add_option("--jobs-per-gpu", o->jobs_per_gpu,
                   "jobs each worker trains at once as one job group (`serve --jobs`; "
                   "default: the worker's, from its GPU's memory)")
      ->check(CLI::Range(1, 64));
  slurm->add_option("--partition,-p", o->partition, "Slurm partition");
  slurm->add_option("--time,-t", o->time, "Slurm time limit, e.g. 2-00:00:00");
  slurm->add_option("--account,-A", o->account, "Slurm account");
  slurm->add_option("--job-name", o->job_name, "Slurm job name")->capture_default_str();
  slurm->add_option("--sbatch", o->sbatch_lines,
                    "one more #SBATCH line, e.g. --sbatch=--constraint=h200 (repeatable)");
  slurm->add_flag("--requeue", o->requeue,
                  "let Slurm restart the pilot when its first node (the coordinator's) is lost");
  slurm->add_option("--coordinator", o->coordinator,
                    "an existing coordinator's tcp:// endpoint (default: the pilot starts one "
                    "on its first node)");
  slurm->add_option("--port", o->port, "where the pilot's coordinator listens")
      ->capture_default_str();
  slurm->add_option("--heartbeat-timeout", o->heartbeat_timeout_s,
                    "the pilot's coordinator: seconds of silence before a worker's job is "
                    "requeued (default: the coordinator's)");
  slurm
      ->add_option("--store-wait", o->store_wait_s,
                   "seconds a worker waits for its node's store to load")
      ->capture_default_str();
  slurm
      ->add_option("--keys", o->keys_dir,
                   "folder of the CURVE keys (created 0700 when missing; on shared storage): "
                   "coordinator/ (made when missing), client/ (yours), workers/RUN/ (this "
                   "pilot's)")
      ->required();
  slurm->add_option("--run-dir", o->run_dir,
                    "folder of the script, its logs and the journal (default: "
                    "runs/slurm-DATE-TIME; on shared storage)");
  slurm->add_option("--bin", o->bin_dir,
                    "folder of the lorastream executables on the nodes (default: this one's)");
  slurm->add_flag("--print", o->print,
                  "print the script on stdout (what to do next goes to stderr): "
                  "`lorastream slurm --print ... > pilot.sbatch`");
  slurm->add_flag("--submit", o->submit, "submit it with sbatch");
  return {slurm, [o] { return RunSlurm(*o, std::cout, o->print ? std::cerr : std::cout); }};
}

Verb DoctorVerb(CLI::App& app, const GlobalOptions& g) {
  auto json = std::make_shared<bool>(false);
  CLI::App* doctor = app.add_subcommand(
      "doctor",
      "what this machine and build can do (build, GPUs, memlock, /dev/shm, huge "
      "pages, host registration, stores, coordinator), each problem with its fix; "
      "exit 1 when it finds a problem (no coordinator is one only when --coordinator or "
      "LORASTREAM_COORDINATOR names one)");
  doctor->add_flag("--json", *json, "JSON object");
  return {
      doctor, [json, &g] {
        // A short wait for the coordinator unless --timeout says otherwise: doctor
        // reports, it does not wait.
        DoctorOptions d{g.endpoint, g.curve_keys, g.timeout_given->count() ? g.timeout_s : 2.0, ""};
        // A coordinator is expected where the user named one; at the default endpoint none
        // running is information, not a problem of the machine.
        d.expect_coordinator =
            g.endpoint_given->count() > 0 || std::getenv("LORASTREAM_COORDINATOR") != nullptr;
        return RunDoctor(d, *json, std::cout);
      }};
}

}  // namespace

int RunLorastreamCli(int argc, char** argv) {
  CLI::App app{
      "lorastream: many LoRA jobs against one RAM-resident base model.\n"
      "The coordinator daemon and the commands that talk to it."};
  app.require_subcommand(1);
  app.fallthrough();  // global options may follow the verb: `lorastream jobs --coordinator X`
  GlobalOptions g;
  g.endpoint_given = app.add_option("--coordinator", g.endpoint, "coordinator endpoint (ZeroMQ)")
                         ->envname("LORASTREAM_COORDINATOR")
                         ->capture_default_str();
  app.add_option("--curve-keys", g.curve_keys,
                 "folder of CURVE keys from `lorastream keygen` (the daemon loads "
                 "coordinator.*, clients load coordinator.pub + client.*)")
      ->envname("LORASTREAM_CURVE_KEYS");
  g.timeout_given = app.add_option("--timeout", g.timeout_s, "seconds to wait for each reply")
                        ->capture_default_str();

  const std::vector<Verb> verbs = {
      CoordinatorVerb(app, g), SubmitVerb(app, g), JobsVerb(app, g),    ShowVerb(app, g),
      StatsVerb(app, g),       CancelVerb(app, g), WorkersVerb(app, g), WatchVerb(app, g),
      PrepareVerb(app),        KeygenVerb(app),    UpVerb(app),         DownVerb(app),
      DoctorVerb(app, g),      SlurmVerb(app),
  };
  return RunMain("lorastream", app, argc, argv, [&]() -> int {
    for (const Verb& verb : verbs)
      if (verb.command->parsed()) return verb.run();
    return 0;  // not reached: exactly one verb is required
  });
}

}  // namespace lorastream::cli
