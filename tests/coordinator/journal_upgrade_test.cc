// The journal across builds: journals written by earlier builds (tests/fixtures/journal-*) open
// with every job as it was, a job's spec is kept in a form later builds read (a job file with
// every key), and a journal from a newer build is refused naming its version.
#include <catch2/catch.hpp>

#include <sqlite3.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>

#include "common/base/error.h"
#include "common/job/flux_job.h"
#include "common/job/job_paths.h"
#include "common/job/job_spec.h"
#include "coordinator/daemon/journal.h"
#include "tests/support/test_support.h"

using namespace lorastream;
using namespace lorastream::coordinator;
namespace fs = std::filesystem;

namespace {

const fs::path kFixture = fs::path(LORASTREAM_SOURCE_DIR) / "tests/fixtures/journal-19d7a07";

std::string ReadText(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// A copy of the fixture (opening a journal upgrades it in place).
fs::path CopyFixture(const testing::TempDir& dir) {
  const fs::path path = dir.path() / "journal.db";
  fs::copy_file(kFixture / "journal.db", path);
  return path;
}

void Sql(const fs::path& db_path, const std::string& sql) {
  sqlite3* db = nullptr;
  REQUIRE(sqlite3_open(db_path.c_str(), &db) == SQLITE_OK);
  char* err = nullptr;
  const int rc = sqlite3_exec(db, sql.c_str(), nullptr, nullptr, &err);
  INFO(sql << ": " << (err ? err : ""));
  sqlite3_free(err);
  sqlite3_close(db);
  REQUIRE(rc == SQLITE_OK);
}

int64_t SqlInt(const fs::path& db_path, const std::string& sql) {
  sqlite3* db = nullptr;
  REQUIRE(sqlite3_open(db_path.c_str(), &db) == SQLITE_OK);
  sqlite3_stmt* st = nullptr;
  REQUIRE(sqlite3_prepare_v2(db, sql.c_str(), -1, &st, nullptr) == SQLITE_OK);
  const int64_t v = sqlite3_step(st) == SQLITE_ROW ? sqlite3_column_int64(st, 0) : -1;
  sqlite3_finalize(st);
  sqlite3_close(db);
  return v;
}

// The spec `lorastream submit` made of the fixture's job file (as make_journal.cc did).
JobSpec Submitted(const std::string& file, int64_t priority) {
  const std::string source = "/home/ada/jobs/" + file;
  JobSpec s = ParseJobSpec(ReadText(kFixture / "jobs" / file), source);
  ResolveJobSpecIn(s, JobFileDir(source));
  if (priority != 0) s.priority = priority;
  return s;
}

// The jobs `specs` (ids 1, 2, ...; each submitted as the job file `text`) saved in a new
// journal in `dir`, as a reopened journal loads them.
std::vector<JobRecord> SavedAndReloaded(const fs::path& dir, const std::vector<JobSpec>& specs,
                                        const std::string& text) {
  const fs::path path = dir / "journal.db";
  {
    Journal journal(path.string());
    for (size_t i = 0; i < specs.size(); ++i) {
      JobRecord r;
      r.summary.id = static_cast<int64_t>(i) + 1;
      r.summary.name = specs[i].name;
      r.spec = specs[i];
      r.summary.spec_source = specs[i].source;
      r.spec_toml = text;
      journal.SaveJob(r);
    }
  }
  return Journal(path.string()).LoadJobs();
}

void CheckSameSpec(const JobSpec& got, const JobSpec& want) {
  CHECK(got.name == want.name);
  CHECK(got.source == want.source);
  CHECK(JobSpecToToml(got) == JobSpecToToml(want));  // every key, written out
  CHECK(SerializePayload(got) == SerializePayload(want));
}

// Every job of the fixture, field by field, as make_journal.cc wrote it.
void CheckFixtureJobs(const Journal& journal) {
  const std::vector<JobRecord> jobs = journal.LoadJobs();
  REQUIRE(jobs.size() == 5);
  const char* files[] = {"chat.toml", "code.toml", "epochs.toml", "broken.toml", "stopped.toml"};
  for (size_t i = 0; i < jobs.size(); ++i) {
    INFO("job " << i + 1);
    CHECK(jobs[i].summary.id == static_cast<int64_t>(i + 1));
    CHECK(jobs[i].spec_toml == ReadText(kFixture / "jobs" / files[i]));
    CheckSameSpec(jobs[i].spec, Submitted(files[i], i == 0 ? 5 : 0));
    CHECK(jobs[i].summary.submitter == "ada");
    CHECK(jobs[i].summary.submitter_uid == 1000);
    CHECK(jobs[i].summary.submitted_at == 1764600000.25 + static_cast<double>(i + 1));
  }
  const JobRecord& queued = jobs[0];
  CHECK(queued.summary.state == JobState::kQueued);
  CHECK(queued.summary.priority == 5);
  CHECK(queued.spec.priority == 5);
  CHECK(queued.spec.model.store == "tiny");
  CHECK(queued.spec.data.path == "/home/ada/data/chat.jsonl");
  CHECK(queued.spec.data.format == "jsonl");
  CHECK(queued.spec.eval.split == 0.1);
  CHECK(queued.spec.eval.every == 20);
  CHECK(queued.spec.eval.batches == 4);
  CHECK(queued.spec.train.checkpoint_every == 50);
  CHECK(queued.spec.train.keep_checkpoints == 3);
  CHECK(queued.spec.train.keep_best);
  CHECK(queued.spec.train.output_dir == "/home/ada/jobs/out/chat");
  CHECK(queued.spec.stream.gpu_memory_budget == (8ull << 30));
  CHECK(queued.spec.optim.schedule == "cosine");
  CHECK(queued.spec.lora.targets == std::vector<std::string>{"q_proj", "v_proj"});

  const JobRecord& running = jobs[1];
  CHECK(running.summary.state == JobState::kRunning);
  CHECK(running.summary.worker_id == "node1-cuda:0");
  CHECK(running.summary.worker_device == "cuda:0");
  CHECK(running.summary.fingerprint == "fp-2f1c");
  CHECK(running.summary.attempt == 2);
  CHECK(running.retries == 1);
  CHECK(running.summary.step == 137);
  CHECK(running.summary.checkpoint_step == 100);
  CHECK(running.summary.checkpoint_path == "/runs/code/checkpoint-100");
  CHECK(running.summary.started_at == 1764600100.5);
  CHECK(running.owner == "rq:7w0Ke3Hmd@%uYh!sqmXg8b^a^x!i9Uo2h=K]ZS");
  CHECK(running.spec.model.checkpoint == "/models/tiny-llama");
  CHECK(running.spec.data.format == "tokens");
  CHECK(running.spec.eval.path == "/home/ada/jobs/valid.jsonl");
  CHECK(running.spec.eval.format == "jsonl");
  CHECK(running.spec.eval.every == 25);
  CHECK(running.spec.train.stats_file == "/runs/code-stats.jsonl");
  CHECK(running.spec.stream.blocks_to_swap == 2);
  CHECK(running.spec.stream.ring_size == 3);
  CHECK_FALSE(running.spec.stream.budget_auto);
  CHECK(running.spec.lora.rslora);

  const JobRecord& done = jobs[2];
  CHECK(done.summary.state == JobState::kSucceeded);
  CHECK(done.summary.total_steps == 38);
  CHECK(done.summary.adapter_path == "/home/ada/jobs/out/summaries");
  CHECK(done.summary.checkpoint_path == "/home/ada/jobs/out/summaries/checkpoint-38");
  CHECK(done.summary.finished_at == 1764600900.75);
  CHECK(done.spec.train.epochs == 1.5);
  CHECK(done.spec.train.dtype == "f32");
  CHECK(done.spec.eval.split == 0.05);
  CHECK(done.spec.optim.weight_decay == 0.01);

  const JobRecord& failed = jobs[3];
  CHECK(failed.summary.state == JobState::kFailed);
  CHECK(failed.summary.reason ==
        "/home/ada/jobs/missing.jsonl: cannot open data file: No such file or directory");
  CHECK(failed.summary.worker_device == "cpu");

  const JobRecord& cancelled = jobs[4];
  CHECK(cancelled.summary.state == JobState::kCancelled);
  CHECK(cancelled.summary.reason == "cancelled by ada");
  CHECK(cancelled.summary.cancel_requested);
  CHECK(cancelled.summary.step == 240);
  CHECK(cancelled.summary.checkpoint_step == 200);
  CHECK(cancelled.spec.stream.budget_auto);
  CHECK(cancelled.spec.stream.taped_blocks == -1);

  const std::vector<StepStats> stats = journal.LoadStats(2);
  REQUIRE(stats.size() == 3);
  CHECK(stats[0].step == 25);
  CHECK(stats[2].loss == 1.75);
  CHECK(stats[1].eval_loss == 2.125);
  CHECK(stats[1].eval_tokens == 4096);
  CHECK_FALSE(stats[0].has_eval());
  CHECK(stats[0].h2d_bytes == (1ull << 33));
}

// The fixture written at 3deb393 (the released build before FLUX.1 jobs shared every family's
// sections): LLM jobs in every state and FLUX.1 jobs in the [flux]-only form.
const fs::path kFixture3deb393 = fs::path(LORASTREAM_SOURCE_DIR) / "tests/fixtures/journal-3deb393";

// Its jobs in id order: the job file and the priority `submit --priority` gave (0: none).
struct FixtureJob {
  const char* file;
  int64_t priority;
};
constexpr FixtureJob k3deb393Jobs[] = {{"chat.toml", 5},
                                       {"code.toml", 0},
                                       {"summaries.toml", 0},
                                       {"broken.toml", 0},
                                       {"stopped.toml", 0},
                                       {"flux-store.toml", 0},
                                       {"flux-checkpoint.toml", 0},
                                       {"flux-done.toml", 2},
                                       {"flux-swap.toml", 0}};

// The spec this build's `lorastream submit` makes of the 3deb393 fixture's job file.
JobSpec Submitted3deb393(const std::string& file, int64_t priority) {
  const std::string source = "/home/ada/jobs/" + file;
  JobSpec s = ParseJobSpec(ReadText(kFixture3deb393 / "jobs" / file), source);
  ResolveJobSpecIn(s, JobFileDir(source));
  if (priority != 0) s.priority = priority;
  return s;
}

// What every family's trainer reads of a FLUX.1 job (MirrorFluxJob) is its [flux] section's.
void CheckFluxMirrored(const JobSpec& s) {
  CHECK(s.model.store == s.flux.store);
  CHECK(s.model.checkpoint == s.flux.checkpoint);
  CHECK(s.train.output_dir == s.flux.output_dir);
  CHECK(s.train.steps == s.flux.steps);
  CHECK(s.train.checkpoint_every == s.flux.save_every);
  CHECK(s.train.keep_checkpoints == s.flux.keep_checkpoints);
  CHECK(s.train.seed == s.flux.seed);
  CHECK(s.train.batch_size == s.flux.batch_size);
  CHECK(s.train.dtype == s.flux.dtype);
  CHECK(s.optim.lr == s.flux.learning_rate);
  CHECK(s.optim.schedule == s.flux.lr_schedule);
  CHECK(s.optim.warmup_steps == s.flux.warmup_steps);
  CHECK(s.optim.weight_decay == s.flux.weight_decay);
  CHECK(s.optim.grad_clip == s.flux.max_grad_norm);
  CHECK(s.lora.rank == s.flux.rank);
  CHECK(s.lora.alpha == s.flux.alpha);
  CHECK(s.lora.targets == s.flux.targets);
}

// Every job of the 3deb393 fixture, field by field, as its make_journal.cc wrote it.
void Check3deb393Jobs(const Journal& journal) {
  const std::vector<JobRecord> jobs = journal.LoadJobs();
  REQUIRE(jobs.size() == std::size(k3deb393Jobs));
  for (size_t i = 0; i < jobs.size(); ++i) {
    const JobRecord& job = jobs[i];
    const FixtureJob& f = k3deb393Jobs[i];
    INFO("job " << i + 1 << " (" << f.file << ")");
    CHECK(job.summary.id == static_cast<int64_t>(i + 1));
    CHECK(job.spec_toml == ReadText(kFixture3deb393 / "jobs" / f.file));
    CHECK(job.summary.spec_source == std::string("/home/ada/jobs/") + f.file);
    CheckSameSpec(job.spec, Submitted3deb393(f.file, f.priority));
    // Its journal form, as this build writes it, reads back the same job.
    CHECK(SerializePayload(ParseJobSpec(JobSpecToToml(job.spec), job.spec.source)) ==
          SerializePayload(job.spec));
    CHECK(Journal::RecordProblem(job.spec).empty());
    CHECK(job.summary.name == job.spec.name);
    CHECK(job.summary.priority == job.spec.priority);
    CHECK(job.summary.store_name == job.spec.model.store);
    CHECK(job.summary.output_dir == job.spec.train.output_dir);
    CHECK(job.summary.submitter == "ada");
    CHECK(job.summary.submitter_uid == 1000);
    CHECK(job.summary.submitted_at == 1765000000.25 + static_cast<double>(i + 1));
    CHECK(job.spec.is_flux == (i >= 5));
    if (job.spec.is_flux) CheckFluxMirrored(job.spec);
  }

  // The LLM jobs.
  const JobRecord& queued = jobs[0];
  CHECK(queued.summary.state == JobState::kQueued);
  CHECK(queued.summary.name == "chat-assistant");
  CHECK(queued.summary.priority == 5);
  CHECK(queued.spec.priority == 5);
  CHECK(queued.summary.worker_id.empty());
  CHECK(queued.summary.store_name == "qwen3-8b");
  CHECK(queued.summary.output_dir == "/home/ada/jobs/out/chat");
  CHECK(queued.summary.total_steps == 400);
  CHECK(queued.spec.model.store == "qwen3-8b");
  CHECK(queued.spec.data.path == "/home/ada/data/chat.jsonl");
  CHECK(queued.spec.data.format == "jsonl");
  CHECK(queued.spec.data.seq_len == 1024);
  CHECK_FALSE(queued.spec.data.packing);
  CHECK(queued.spec.lora.rank == 8);
  CHECK(queued.spec.lora.targets ==
        std::vector<std::string>{"q_proj", "k_proj", "v_proj", "o_proj"});
  CHECK(queued.spec.optim.schedule == "cosine");
  CHECK(queued.spec.train.grad_accum == 4);
  CHECK(queued.spec.train.seed == 11);
  CHECK(queued.spec.train.keep_best);
  CHECK(queued.spec.eval.split == 0.1);
  CHECK(queued.spec.eval.batches == 8);
  CHECK(queued.spec.stream.gpu_memory_budget == (8ull << 30));
  CHECK_FALSE(queued.spec.stream.budget_auto);

  const JobRecord& running = jobs[1];
  CHECK(running.summary.state == JobState::kRunning);
  CHECK(running.summary.name == "code-completion");
  CHECK(running.summary.priority == 0);
  CHECK(running.summary.worker_id == "node1-cuda:0");
  CHECK(running.summary.worker_host == "node1");
  CHECK(running.summary.worker_device == "cuda:0");
  CHECK(running.summary.fingerprint == "fp-8b3e");
  CHECK(running.summary.attempt == 2);
  CHECK(running.retries == 1);
  CHECK(running.summary.step == 412);
  CHECK(running.summary.checkpoint_step == 400);
  CHECK(running.summary.checkpoint_path == "/runs/code/checkpoint-400");
  CHECK(running.summary.started_at == 1765000100.5);
  CHECK(running.owner == "rq:Zx1!k9#Lp0v@Qm4^t&Yw7*Rb2(Hs6)Ne3%Jd8");
  CHECK(running.summary.store_name.empty());
  CHECK(running.summary.output_dir == "/runs/code");
  CHECK(running.summary.total_steps == 600);
  CHECK(running.spec.model.checkpoint == "/models/Qwen3-8B");
  CHECK(running.spec.data.format == "tokens");
  CHECK(running.spec.eval.path == "/home/ada/jobs/valid.jsonl");
  CHECK(running.spec.train.dtype == "bf16");
  CHECK(running.spec.train.stats_file == "/runs/code-stats.jsonl");
  CHECK(running.spec.lora.rank == 32);
  CHECK(running.spec.lora.rslora);
  CHECK(running.spec.lora.dropout == 0.05);
  CHECK(running.spec.stream.blocks_to_swap == 12);
  CHECK(running.spec.stream.ring_size == 3);
  CHECK(running.spec.stream.forward_slots == 4);
  CHECK(running.spec.stream.backward_slots == -1);

  const JobRecord& done = jobs[2];
  CHECK(done.summary.state == JobState::kSucceeded);
  CHECK(done.summary.name == "summaries by epochs");
  CHECK(done.summary.worker_id == "node1-cuda:1");
  CHECK(done.summary.total_steps == 76);
  CHECK(done.summary.step == 76);
  CHECK(done.summary.adapter_path == "/home/ada/jobs/out/summaries");
  CHECK(done.summary.checkpoint_path == "/home/ada/jobs/out/summaries/checkpoint-76");
  CHECK(done.summary.finished_at == 1765000900.75);
  CHECK(done.spec.train.epochs == 2.0);
  CHECK(done.spec.train.steps == 0);
  CHECK(done.spec.train.dtype == "f32");
  CHECK(done.spec.optim.grad_clip == 0.5);

  const JobRecord& failed = jobs[3];
  CHECK(failed.summary.state == JobState::kFailed);
  CHECK(failed.summary.reason ==
        "/home/ada/jobs/missing.jsonl: cannot open data file: No such file or directory");
  CHECK(failed.summary.worker_id == "node2-cpu");
  CHECK(failed.summary.worker_device == "cpu");
  CHECK(failed.summary.total_steps == 50);
  CHECK(failed.spec.data.path == "/home/ada/jobs/missing.jsonl");

  const JobRecord& cancelled = jobs[4];
  CHECK(cancelled.summary.state == JobState::kCancelled);
  CHECK(cancelled.summary.reason == "cancelled by ada");
  CHECK(cancelled.summary.cancel_requested);
  CHECK(cancelled.summary.step == 240);
  CHECK(cancelled.summary.checkpoint_step == 200);
  CHECK(cancelled.summary.output_dir == "/home/ada/jobs/out/stopped");
  CHECK(cancelled.spec.stream.budget_auto);
  CHECK(cancelled.spec.stream.taped_blocks == -1);
  CHECK(cancelled.spec.stream.forward_slots == -1);

  // The FLUX.1 jobs.
  const JobRecord& flux_queued = jobs[5];
  const FluxJob& fq = flux_queued.spec.flux;
  CHECK(flux_queued.summary.state == JobState::kQueued);
  CHECK(flux_queued.summary.name == "flux-portraits");
  CHECK(flux_queued.summary.priority == 3);
  CHECK(flux_queued.spec.priority == 3);
  CHECK(flux_queued.summary.worker_id.empty());
  CHECK(flux_queued.summary.store_name == "flux1-dev-fp8");
  CHECK(flux_queued.summary.output_dir == "/home/ada/jobs/out/flux-portraits");
  CHECK(flux_queued.summary.total_steps == 1200);
  CHECK(fq.store == "flux1-dev-fp8");
  CHECK(fq.checkpoint.empty());
  CHECK(fq.cache_dir == "/home/ada/jobs/cache/portraits");
  CHECK(fq.output_dir == "/home/ada/jobs/out/flux-portraits");
  CHECK(fq.steps == 1200);
  CHECK(fq.batch_size == 2);
  CHECK(fq.seed == 42);
  CHECK(fq.learning_rate == 4e-4);
  CHECK(fq.lr_schedule == "cosine");
  CHECK(fq.warmup_steps == 50);
  CHECK(fq.rank == 32);
  CHECK(fq.alpha == 16.0);
  CHECK(fq.targets == std::vector<std::string>{"attention"});
  CHECK(fq.timestep_sampling == "flux_shift");
  CHECK(fq.save_every == 200);
  CHECK(fq.keep_checkpoints == 3);
  CHECK(fq.dtype == "bf16");
  CHECK(fq.gpu_memory_budget == 0);
  CHECK_FALSE(fq.budget_auto);
  CHECK(fq.singles_per_unit == 2);
  CHECK(fq.guidance == 1.0);
  CHECK(fq.weight_decay == 0.01);
  CHECK(fq.max_grad_norm == 1.0);

  const JobRecord& flux_running = jobs[6];
  const FluxJob& fr = flux_running.spec.flux;
  CHECK(flux_running.summary.state == JobState::kRunning);
  CHECK(flux_running.summary.name == "flux-style");
  CHECK(flux_running.summary.priority == 0);
  CHECK(flux_running.summary.worker_id == "node3-cuda:0");
  CHECK(flux_running.summary.worker_host == "node3");
  CHECK(flux_running.summary.worker_device == "cuda:0");
  CHECK(flux_running.summary.fingerprint == "fp-f1ux");
  CHECK(flux_running.summary.step == 250);
  CHECK(flux_running.summary.checkpoint_step == 200);
  CHECK(flux_running.summary.checkpoint_path == "/runs/flux-style/checkpoint-200");
  CHECK(flux_running.summary.started_at == 1765000600.5);
  CHECK(flux_running.owner == "rq:F1uxW0rker-node3");
  CHECK(flux_running.summary.store_name.empty());
  CHECK(flux_running.summary.output_dir == "/runs/flux-style");
  CHECK(flux_running.summary.total_steps == 800);
  CHECK(fr.store.empty());
  CHECK(fr.checkpoint == "/home/ada/models/flux1-dev.safetensors");
  CHECK(fr.cache_dir == "/data/flux/style-cache");
  CHECK(fr.output_dir == "/runs/flux-style");
  CHECK(fr.steps == 800);
  CHECK(fr.learning_rate == 1e-4);
  CHECK(fr.weight_decay == 0.0);
  CHECK(fr.max_grad_norm == 0.0);
  CHECK(fr.rank == 16);
  CHECK(fr.alpha == 8.0);
  CHECK(fr.targets == std::vector<std::string>{"all"});
  CHECK(fr.guidance == 3.5);
  CHECK(fr.timestep_sampling == "shift");
  CHECK(fr.discrete_flow_shift == 3.1582);
  CHECK(fr.save_every == 100);
  CHECK(fr.keep_checkpoints == 2);
  CHECK(fr.dtype == "bf16");
  CHECK(fr.gpu_memory_budget == (8ull << 30));
  CHECK_FALSE(fr.budget_auto);
  CHECK(fr.singles_per_unit == 3);

  const JobRecord& flux_done = jobs[7];
  const FluxJob& fd = flux_done.spec.flux;
  CHECK(flux_done.summary.state == JobState::kSucceeded);
  CHECK(flux_done.summary.name == "flux-logo");
  CHECK(flux_done.summary.priority == 2);
  CHECK(flux_done.spec.priority == 2);
  CHECK(flux_done.summary.worker_id == "node3-cuda:1");
  CHECK(flux_done.summary.step == 300);
  CHECK(flux_done.summary.adapter_path == "/home/ada/jobs/out/flux-logo");
  CHECK(flux_done.summary.checkpoint_path == "/home/ada/jobs/out/flux-logo/checkpoint-300");
  CHECK(flux_done.summary.finished_at == 1765001700.25);
  CHECK(flux_done.summary.store_name == "flux1-dev");
  CHECK(flux_done.summary.output_dir == "/home/ada/jobs/out/flux-logo");
  CHECK(flux_done.summary.total_steps == 300);
  CHECK(fd.store == "flux1-dev");
  CHECK(fd.cache_dir == "/home/ada/jobs/cache/logo");
  CHECK(fd.steps == 300);
  CHECK(fd.lr_schedule == "linear");
  CHECK(fd.rank == 16);
  CHECK(fd.alpha == 16.0);  // the rank's, unwritten
  CHECK(fd.timestep_sampling == "uniform");
  CHECK(fd.sigmoid_scale == 1.5);
  CHECK(fd.budget_auto);
  CHECK(fd.gpu_memory_budget == 0);

  const JobRecord& flux_cancelled = jobs[8];
  const FluxJob& fc = flux_cancelled.spec.flux;
  CHECK(flux_cancelled.summary.state == JobState::kCancelled);
  CHECK(flux_cancelled.summary.name == "flux-swap");
  CHECK(flux_cancelled.summary.reason == "cancelled by ada");
  CHECK(flux_cancelled.summary.cancel_requested);
  CHECK(flux_cancelled.summary.step == 37);
  CHECK(flux_cancelled.summary.total_steps == 500);
  CHECK(flux_cancelled.summary.store_name.empty());
  CHECK(fc.checkpoint == "/models/FLUX.1-dev");
  CHECK(fc.cache_dir == "/home/ada/jobs/cache/swap");
  CHECK(fc.output_dir == "/home/ada/jobs/out/flux-swap");
  CHECK(fc.seed == 7);
  CHECK(fc.rank == 8);
  CHECK(fc.alpha == 8.0);
  CHECK(fc.targets == std::vector<std::string>{"img_attn.qkv", "txt_attn.qkv", "linear1"});
  CHECK(fc.blocks_to_swap == 20);
  CHECK(fc.ring_size == 3);
  CHECK(fc.gpu_memory_budget == 0);
  CHECK_FALSE(fc.budget_auto);
  CHECK(fc.singles_per_unit == 2);

  // Statistics rows of the running LLM job and of the running FLUX.1 job.
  const std::vector<StepStats> stats = journal.LoadStats(2);
  REQUIRE(stats.size() == 3);
  CHECK(stats[0].step == 100);
  CHECK(stats[2].step == 300);
  CHECK(stats[2].loss == 1.75);
  CHECK(stats[0].total_steps == 600);
  CHECK(stats[0].grad_norm == 0.75);
  CHECK(stats[0].copies == 24);
  CHECK(stats[0].copies_saved == 2);
  CHECK(stats[0].peak_device_bytes == (7ull << 30));
  CHECK(stats[0].h2d_bytes == (3ull << 30));
  CHECK(stats[1].eval_loss == 2.125);
  CHECK(stats[1].eval_tokens == 8192);
  CHECK_FALSE(stats[0].has_eval());
  const std::vector<StepStats> flux_stats = journal.LoadStats(7);
  REQUIRE(flux_stats.size() == 2);
  CHECK(flux_stats[0].step == 200);
  CHECK(flux_stats[1].step == 300);
  CHECK(flux_stats[1].loss == 0.25);
  CHECK(flux_stats[1].total_steps == 800);
  CHECK(flux_stats[0].peak_device_bytes == (8ull << 30));
  CHECK(journal.LoadStats(6).empty());
}

}  // namespace

TEST_CASE("a journal written at 19d7a07 opens with every job and statistic as it was",
          "[coordinator][journal]") {
  const testing::TempDir dir("journal-fixture");
  const fs::path path = CopyFixture(dir);
  REQUIRE(SqlInt(path, "PRAGMA user_version") == 0);
  {
    Journal journal(path.string());
    CheckFixtureJobs(journal);
  }
  // Upgraded in place: the spec blobs are gone, the jobs read the same again and stay writable.
  CHECK(SqlInt(path, "PRAGMA user_version") == 1);
  CHECK(SqlInt(path, "SELECT count(*) FROM pragma_table_info('jobs') WHERE name = 'spec_blob'") ==
        0);
  Journal journal(path.string());
  CheckFixtureJobs(journal);
  std::vector<JobRecord> jobs = journal.LoadJobs();
  jobs[0].summary.state = JobState::kRunning;
  jobs[0].spec.train.keep_best = false;
  journal.SaveJob(jobs[0]);
  CHECK(journal.LoadJobs()[0].summary.state == JobState::kRunning);
  CHECK_FALSE(journal.LoadJobs()[0].spec.train.keep_best);
}

TEST_CASE("a version-0 row of an older JobSpec is read from its job file's text",
          "[coordinator][journal]") {
  const testing::TempDir dir("journal-older");
  const fs::path path = CopyFixture(dir);
  // Job 1's spec as a build before [eval] wrote it: the same fields without the trailing
  // evaluation ones (two empty strings and three 8-byte numbers), which the version-0 reader
  // cannot take for a whole record. Its job file's text still says everything.
  Sql(path,
      "UPDATE jobs SET spec_blob = substr(spec_blob, 1, length(spec_blob) - 40) WHERE id = 1");
  Journal journal(path.string());
  CheckFixtureJobs(journal);
}

TEST_CASE("a version-0 row that cannot be read at all leaves the journal as it was",
          "[coordinator][journal]") {
  const testing::TempDir dir("journal-unreadable");
  const fs::path path = CopyFixture(dir);
  Sql(path, "UPDATE jobs SET spec_blob = x'00', spec_toml = 'name = ' WHERE id = 3");
  try {
    Journal journal(path.string());
    FAIL("an unreadable job was accepted");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kCorrupt);
    CHECK_THAT(e.what(), Catch::Contains("job 3 can be read neither from its record"));
  }
  CHECK(SqlInt(path, "PRAGMA user_version") == 0);
  CHECK(SqlInt(path, "SELECT count(*) FROM pragma_table_info('jobs') WHERE name = 'spec_blob'") ==
        1);
}

TEST_CASE("a journal of a newer build is refused naming its version, and left alone",
          "[coordinator][journal]") {
  const testing::TempDir dir("journal-newer");
  const fs::path path = dir.path() / "j.db";
  { Journal journal(path.string()); }
  Sql(path, "PRAGMA user_version = 7");
  try {
    Journal journal(path.string());
    FAIL("a newer journal was opened");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kUnsupported);
    CHECK_THAT(e.what(), Catch::Contains("has version 7, written by a newer lorastream"));
    CHECK_THAT(e.what(), Catch::Contains("reads versions up to 1"));
  }
  CHECK(SqlInt(path, "PRAGMA user_version") == 7);
}

TEST_CASE("a spec reads back from its journal form, every key and awkward value included",
          "[coordinator][journal]") {
  JobSpec s;
  s.name = "quotes \" and \\ and\nnew line, tab\t, \x01 and \xe2\x80\xae bidi";
  s.source = "/jobs/a.toml";
  s.priority = -3;
  s.model.checkpoint = "/m";
  s.data.path = "/d.jsonl";
  s.data.format = "jsonl";
  s.data.packing = false;
  s.lora.alpha = 0.1 + 0.2;  // not a short decimal
  s.lora.targets = {"o_proj"};
  s.optim.lr = 1.0 / 3.0;
  s.optim.eps = 1e-300;
  s.train.seed = (uint64_t{1} << 63) - 1;
  s.train.epochs = 2.5;
  s.stream.gpu_memory_budget = (uint64_t{1} << 40) + 7;
  s.stream.forward_slots = -1;
  const JobSpec back = ParseJobSpec(JobSpecToToml(s), s.source);
  CHECK(SerializePayload(back) == SerializePayload(s));
  CHECK(Journal::RecordProblem(s).empty());
  s.stream.budget_auto = true;
  s.stream.gpu_memory_budget = 0;
  CHECK(SerializePayload(ParseJobSpec(JobSpecToToml(s), s.source)) == SerializePayload(s));

  // What no job file can say is refused at submission rather than changed by the journal.
  s.train.seed = uint64_t{1} << 63;
  CHECK_FALSE(Journal::RecordProblem(s).empty());
}

TEST_CASE("a FLUX job's spec reads back from its journal form and through a reopened journal",
          "[coordinator][journal]") {
  const std::string text =
      "name = \"flux\"\npriority = 2\n[flux]\nstore = \"flux-tiny\"\ncache_dir = \"cache\"\n"
      "output_dir = \"out\"\nsteps = 7\nlearning_rate = 3.3e-4\nalpha = 0.30000000000000004\n"
      "targets = [\"attention\"]\ngpu_memory_budget = \"8GiB\"\nseed = 9\nsave_every = 2\n";
  JobSpec s = ParseJobSpec(text, "/jobs/flux.toml");
  ResolveJobSpecIn(s, "/jobs");
  REQUIRE(s.is_flux);
  CHECK(SerializePayload(ParseJobSpec(JobSpecToToml(s), s.source)) == SerializePayload(s));
  CHECK(Journal::RecordProblem(s).empty());
  JobSpec on_checkpoint = s;  // a checkpoint job keeps its singles_per_unit; "auto" budget
  on_checkpoint.flux.store.clear();
  on_checkpoint.flux.checkpoint = "/models/flux1-dev.safetensors";
  on_checkpoint.flux.singles_per_unit = 3;
  on_checkpoint.flux.budget_auto = true;
  on_checkpoint.flux.gpu_memory_budget = 0;
  on_checkpoint = ParseJobSpec(JobSpecToToml(on_checkpoint), s.source);
  CHECK(on_checkpoint.model.checkpoint == "/models/flux1-dev.safetensors");
  CHECK(on_checkpoint.flux.singles_per_unit == 3);
  CHECK(on_checkpoint.flux.budget_auto);
  CHECK(SerializePayload(ParseJobSpec(JobSpecToToml(on_checkpoint), s.source)) ==
        SerializePayload(on_checkpoint));

  const testing::TempDir dir("journal-flux");
  const std::vector<JobRecord> jobs = SavedAndReloaded(dir.path(), {s, on_checkpoint}, text);
  REQUIRE(jobs.size() == 2);
  CheckSameSpec(jobs[0].spec, s);
  CheckSameSpec(jobs[1].spec, on_checkpoint);
}

TEST_CASE("a journal written at 3deb393 with FLUX.1 and LLM jobs opens with every job as it was",
          "[coordinator][journal]") {
  const testing::TempDir dir("journal-3deb393");
  const fs::path path = dir.path() / "journal.db";
  fs::copy_file(kFixture3deb393 / "journal.db", path);
  REQUIRE(SqlInt(path, "PRAGMA user_version") == 1);
  // As 3deb393 kept them: every spec a job file, the FLUX.1 ones in the [flux]-only form.
  REQUIRE(SqlInt(path,
                 "SELECT count(*) FROM jobs WHERE spec LIKE '%[flux]%' AND spec NOT LIKE "
                 "'%[model]%' AND spec NOT LIKE '%[train]%'") == 4);
  REQUIRE(SqlInt(path, "SELECT count(*) FROM stats") == 5);
  {
    const Journal journal(path.string());
    Check3deb393Jobs(journal);
  }
  CHECK(SqlInt(path, "PRAGMA user_version") == 1);
  // Reopened, the same again; and writable: a FLUX.1 job this build saves reads back the same.
  Journal journal(path.string());
  Check3deb393Jobs(journal);
  std::vector<JobRecord> jobs = journal.LoadJobs();
  jobs[6].summary.state = JobState::kSucceeded;
  jobs[6].summary.step = 800;
  journal.SaveJob(jobs[6]);
  const JobRecord back = journal.LoadJobs()[6];
  CHECK(back.summary.state == JobState::kSucceeded);
  CHECK(back.summary.step == 800);
  CheckSameSpec(back.spec, jobs[6].spec);
  CHECK(back.spec.is_flux);
  CHECK(back.spec.flux.singles_per_unit == 3);
}

TEST_CASE("a FLUX job in the shared form keeps its form through the journal",
          "[coordinator][journal]") {
  const std::string text =
      "name = \"flux\"\n[model]\nstore = \"flux-tiny\"\n[train]\noutput_dir = \"out\"\n"
      "[stream]\ngpu_memory_budget = \"8GiB\"\n[flux]\ncache_dir = \"cache\"\n";
  JobSpec s = ParseJobSpec(text, "/jobs/flux.toml");
  ResolveJobSpecIn(s, "/jobs");
  REQUIRE(s.flux.shared_form);
  CHECK(Journal::RecordProblem(s).empty());
  const testing::TempDir dir("journal-flux-shared");
  const std::vector<JobRecord> jobs = SavedAndReloaded(dir.path(), {s}, text);
  REQUIRE(jobs.size() == 1);
  CHECK(jobs[0].spec.flux.shared_form);
  CheckSameSpec(jobs[0].spec, s);
  CHECK(FluxKeyName(jobs[0].spec.flux, "store") == "model.store");
}
