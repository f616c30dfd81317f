// The journal across builds: journals written by earlier builds (tests/fixtures/journal-*) open
// with every job as it was, a job's spec is kept in a form later builds read (a job file with
// every key), and a journal from a newer build is refused naming its version.
#include <catch2/catch.hpp>

#include <sqlite3.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "common/error.h"
#include "common/job_paths.h"
#include "common/job_spec.h"
#include "coordinator/journal.h"
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
  const fs::path path = dir.path() / "journal.db";
  {
    Journal journal(path.string());
    for (const JobSpec& spec : {s, on_checkpoint}) {
      JobRecord r;
      r.summary.id = spec.flux.store.empty() ? 2 : 1;
      r.summary.name = spec.name;
      r.spec = spec;
      r.summary.spec_source = spec.source;
      r.spec_toml = text;
      journal.SaveJob(r);
    }
  }
  const Journal journal(path.string());
  const std::vector<JobRecord> jobs = journal.LoadJobs();
  REQUIRE(jobs.size() == 2);
  CheckSameSpec(jobs[0].spec, s);
  CheckSameSpec(jobs[1].spec, on_checkpoint);
}
