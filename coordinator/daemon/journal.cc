#include "coordinator/daemon/journal.h"

#include <fcntl.h>
#include <sqlite3.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <limits>
#include <utility>

#include "common/base/error.h"
#include "common/base/log.h"
#include "common/job/flux_job.h"
#include "common/job/job_paths.h"
#include "common/protocol/message_archive.h"

namespace lorastream::coordinator {
namespace {

// One prepared statement; finalized on every path out (RAII).
class Statement {
 public:
  Statement(sqlite3* db, const char* sql, const std::string& path) : db_(db), path_(path) {
    if (sqlite3_prepare_v2(db, sql, -1, &stmt_, nullptr) != SQLITE_OK)
      throw Error(ErrorCode::kCorrupt, "journal " + path + ": " + sqlite3_errmsg(db));
  }
  ~Statement() { sqlite3_finalize(stmt_); }
  Statement(const Statement&) = delete;
  Statement& operator=(const Statement&) = delete;

  Statement& Bind(int i, int64_t v) {
    sqlite3_bind_int64(stmt_, i, v);
    return *this;
  }
  Statement& Bind(int i, double v) {
    sqlite3_bind_double(stmt_, i, v);
    return *this;
  }
  // NaN ("none") as SQL NULL, and back.
  Statement& BindOptional(int i, double v) {
    if (std::isnan(v))
      sqlite3_bind_null(stmt_, i);
    else
      sqlite3_bind_double(stmt_, i, v);
    return *this;
  }
  Statement& Bind(int i, const std::string& v) {
    sqlite3_bind_text(stmt_, i, v.data(), static_cast<int>(v.size()), SQLITE_TRANSIENT);
    return *this;
  }
  Statement& BindBlob(int i, const std::string& v) {
    sqlite3_bind_blob(stmt_, i, v.data(), static_cast<int>(v.size()), SQLITE_TRANSIENT);
    return *this;
  }
  bool Step() {
    int rc = sqlite3_step(stmt_);
    if (rc == SQLITE_ROW) return true;
    if (rc == SQLITE_DONE) return false;
    throw Error(ErrorCode::kIo, "journal " + path_ + ": " + sqlite3_errmsg(db_));
  }
  int64_t Int(int col) const { return sqlite3_column_int64(stmt_, col); }
  bool IsNull(int col) const { return sqlite3_column_type(stmt_, col) == SQLITE_NULL; }
  double Real(int col) const { return sqlite3_column_double(stmt_, col); }
  double OptionalReal(int col) const {
    return sqlite3_column_type(stmt_, col) == SQLITE_NULL ? std::numeric_limits<double>::quiet_NaN()
                                                          : sqlite3_column_double(stmt_, col);
  }
  std::string Text(int col) const {
    const unsigned char* p = sqlite3_column_text(stmt_, col);
    return p ? std::string(reinterpret_cast<const char*>(p),
                           static_cast<size_t>(sqlite3_column_bytes(stmt_, col)))
             : std::string();
  }

 private:
  sqlite3* db_;
  sqlite3_stmt* stmt_ = nullptr;
  const std::string& path_;
};

// The journal's layout, in SQLite's user_version (0 in a journal written before there was one):
//   0  a job's spec is a cereal blob of JobSpec (column spec_blob), which a build whose JobSpec
//      has other fields cannot read;
//   1  a job's spec is a job file with every key written out (column spec, JobSpecToToml),
//      read back with ParseJobSpec: a key added later takes its default.
// A build opens every version up to its own, upgrading the file in one transaction, and
// refuses a newer one.
constexpr int64_t kJournalVersion = 1;

constexpr const char* kSchema = R"sql(
CREATE TABLE jobs (
  id INTEGER PRIMARY KEY, name TEXT, state INTEGER, reason TEXT, priority INTEGER,
  store_name TEXT, fingerprint TEXT, spec_source TEXT, spec_toml TEXT, spec TEXT, output_dir TEXT,
  adapter_path TEXT, worker_id TEXT, worker_host TEXT, worker_device TEXT, attempt INTEGER,
  retries INTEGER, step INTEGER, total_steps INTEGER, checkpoint_step INTEGER,
  checkpoint_path TEXT, cancel_requested INTEGER, submitted_at REAL, started_at REAL,
  finished_at REAL, owner TEXT, submitter_uid INTEGER, submitter TEXT);
CREATE TABLE stats (
  job_id INTEGER, step INTEGER, attempt INTEGER, total_steps INTEGER, loss REAL,
  learning_rate REAL, grad_norm REAL, tokens INTEGER, step_seconds REAL,
  tokens_per_second REAL, h2d_bytes INTEGER, h2d_busy_seconds REAL, stall_seconds REAL,
  copies INTEGER, copies_saved INTEGER, peak_device_bytes INTEGER, eval_loss REAL,
  eval_tokens INTEGER, PRIMARY KEY (job_id, step));
)sql";

// The columns of a job row, in the order SaveJob binds and LoadJobs reads them (a journal
// upgraded from version 0 holds them in another order: always named).
constexpr const char* kJobColumns =
    "id, name, state, reason, priority, store_name, fingerprint, spec_source, spec_toml, spec,"
    " output_dir, adapter_path, worker_id, worker_host, worker_device, attempt, retries, step,"
    " total_steps, checkpoint_step, checkpoint_path, cancel_requested, submitted_at, started_at,"
    " finished_at, owner, submitter_uid, submitter";

template <class Frozen, class Field>
void ReadAs(MessageInputArchive& ar, Field& field) {
  Frozen value{};
  ar(value);
  field = static_cast<Field>(value);
}

// A version-0 row's spec_blob: JobSpec's cereal fields in the order and with the types that
// version wrote, spelled out here so that a later JobSpec cannot change how they read.
JobSpec DecodeVersion0Spec(std::string_view blob) {
  using Strings = std::vector<std::string>;
  JobSpec s;
  MessageInputArchive ar(blob.data(), blob.size());
  ReadAs<std::string>(ar, s.name);
  ReadAs<int64_t>(ar, s.priority);
  ReadAs<std::string>(ar, s.model.store);
  ReadAs<std::string>(ar, s.model.checkpoint);
  ReadAs<std::string>(ar, s.data.path);
  ReadAs<std::string>(ar, s.data.format);
  ReadAs<int64_t>(ar, s.data.seq_len);
  ReadAs<bool>(ar, s.data.packing);
  ReadAs<int64_t>(ar, s.data.pad_id);
  ReadAs<int64_t>(ar, s.lora.rank);
  ReadAs<double>(ar, s.lora.alpha);
  ReadAs<double>(ar, s.lora.dropout);
  ReadAs<Strings>(ar, s.lora.targets);
  ReadAs<bool>(ar, s.lora.rslora);
  ReadAs<double>(ar, s.optim.lr);
  ReadAs<double>(ar, s.optim.beta1);
  ReadAs<double>(ar, s.optim.beta2);
  ReadAs<double>(ar, s.optim.eps);
  ReadAs<double>(ar, s.optim.weight_decay);
  ReadAs<std::string>(ar, s.optim.schedule);
  ReadAs<int64_t>(ar, s.optim.warmup_steps);
  ReadAs<double>(ar, s.optim.grad_clip);
  ReadAs<int64_t>(ar, s.train.steps);
  ReadAs<int64_t>(ar, s.train.batch_size);
  ReadAs<int64_t>(ar, s.train.grad_accum);
  ReadAs<uint64_t>(ar, s.train.seed);
  ReadAs<int64_t>(ar, s.train.checkpoint_every);
  ReadAs<std::string>(ar, s.train.output_dir);
  ReadAs<std::string>(ar, s.train.dtype);
  ReadAs<std::string>(ar, s.train.stats_file);
  ReadAs<int64_t>(ar, s.train.keep_checkpoints);
  ReadAs<bool>(ar, s.train.keep_best);
  ReadAs<double>(ar, s.train.epochs);
  ReadAs<int64_t>(ar, s.stream.blocks_to_swap);
  ReadAs<uint64_t>(ar, s.stream.gpu_memory_budget);
  ReadAs<bool>(ar, s.stream.budget_auto);
  ReadAs<int64_t>(ar, s.stream.ring_size);
  ReadAs<int64_t>(ar, s.stream.forward_slots);
  ReadAs<int64_t>(ar, s.stream.backward_slots);
  ReadAs<int64_t>(ar, s.stream.taped_blocks);
  ReadAs<std::string>(ar, s.source);
  ReadAs<std::string>(ar, s.eval.path);
  ReadAs<std::string>(ar, s.eval.format);
  ReadAs<double>(ar, s.eval.split);
  ReadAs<int64_t>(ar, s.eval.every);
  ReadAs<int64_t>(ar, s.eval.batches);
  if (ar.remaining() != 0)
    throw Error(ErrorCode::kCorrupt, std::to_string(ar.remaining()) + " bytes left over");
  return s;
}

// A version-0 row's spec: its blob, else (a blob of an older JobSpec, without the keys added
// since) the job file's text as submitted, parsed and resolved as `submit` did then.
JobSpec Version0Spec(std::string_view blob, const std::string& toml, const std::string& source,
                     int64_t priority, const std::string& what) {
  std::string blob_problem;
  try {
    return DecodeVersion0Spec(blob);
  } catch (const std::exception& e) {
    blob_problem = e.what();
  }
  try {
    JobSpec s = ParseJobSpec(toml, source);
    ResolveJobSpecIn(s, source.empty() ? "" : JobFileDir(source));
    s.priority = priority;
    return s;
  } catch (const std::exception& e) {
    throw Error(ErrorCode::kCorrupt, what + " can be read neither from its record (" +
                                         blob_problem + ") nor from its job file's text (" +
                                         e.what() + ")");
  }
}

// Creates the journal owner-only before SQLite opens it (SQLite gives its -wal and -shm
// files the database's permissions) and tightens files an older version left readable.
void MakeOwnerOnly(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) ThrowErrno("cannot open journal " + path);
  ::close(fd);
  for (const std::string& file : {path, path + "-wal", path + "-shm"}) {
    struct stat st {};
    if (::stat(file.c_str(), &st) == 0 && st.st_uid == ::geteuid() && (st.st_mode & 077) &&
        ::chmod(file.c_str(), st.st_mode & 0700) != 0)
      ThrowErrno("cannot make journal file " + file + " owner-only");
  }
}

}  // namespace

// One transaction: a crash or an error leaves the journal as it was before (Rollback on
// destruction unless committed).
class Journal::Transaction {
 public:
  explicit Transaction(const Journal& journal) : journal_(journal) {
    journal_.Exec("BEGIN IMMEDIATE");
  }
  ~Transaction() {
    if (!committed_) sqlite3_exec(journal_.db_, "ROLLBACK", nullptr, nullptr, nullptr);
  }
  Transaction(const Transaction&) = delete;
  Transaction& operator=(const Transaction&) = delete;
  void Commit() {
    journal_.Exec("COMMIT");
    committed_ = true;
  }

 private:
  const Journal& journal_;
  bool committed_ = false;
};

Journal::Journal(const std::string& path) : path_(path) {
  if (path != ":memory:") {
    lock_ = FileLock::Acquire(path + ".lock", "coordinator pid " + std::to_string(::getpid()),
                              "journal " + path);
    MakeOwnerOnly(path);
  }
  if (sqlite3_open_v2(path.c_str(), &db_, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE, nullptr) !=
      SQLITE_OK) {
    std::string msg = db_ ? sqlite3_errmsg(db_) : "out of memory";
    sqlite3_close(db_);
    db_ = nullptr;
    throw Error(ErrorCode::kIo, "cannot open journal " + path + ": " + msg);
  }
  sqlite3_busy_timeout(db_, 5000);
  try {
    const int64_t version = Int("PRAGMA user_version");
    if (version < 0)
      throw Error(ErrorCode::kCorrupt,
                  "journal " + path + " has version " + std::to_string(version) +
                      ", which no lorastream writes (damaged or not a journal); it is left "
                      "as it is");
    if (version > kJournalVersion)
      throw Error(ErrorCode::kUnsupported,
                  "journal " + path + " has version " + std::to_string(version) +
                      ", written by a newer lorastream; this build reads versions up to " +
                      std::to_string(kJournalVersion) +
                      ": run the newer lorastream (this one leaves the journal as it is)");
    // WAL + synchronous=NORMAL: a committed transaction survives a crash of the coordinator
    // process (the WAL is in the OS page cache); only a power loss may drop the last ones.
    Exec("PRAGMA journal_mode=WAL");
    Exec("PRAGMA synchronous=NORMAL");
    if (Int("SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'jobs'") == 0) {
      // A new journal is an empty database; one holding other things is not a journal.
      if (Int("SELECT count(*) FROM sqlite_master") != 0)
        throw Error(ErrorCode::kCorrupt,
                    "journal " + path +
                        " has no jobs table but holds other tables (damaged, or not a "
                        "lorastream journal); it is left as it is");
      Transaction create(*this);
      Exec(kSchema);
      Exec(("PRAGMA user_version = " + std::to_string(kJournalVersion)).c_str());
      create.Commit();
    } else if (version < 1) {
      if (!HasColumn("jobs", "spec_blob") || HasColumn("jobs", "spec"))
        throw Error(ErrorCode::kCorrupt,
                    "journal " + path +
                        " says version 0, but its jobs table is not version 0's (a spec_blob "
                        "column and no spec column): damaged; it is left as it is");
      UpgradeToVersion1();
    }
    // Every column a job row is read from: a table without one is not this version's.
    std::string columns = kJobColumns;
    for (size_t start = 0; start < columns.size();) {
      size_t end = columns.find(',', start);
      if (end == std::string::npos) end = columns.size();
      std::string column = columns.substr(start, end - start);
      column.erase(0, column.find_first_not_of(' '));
      if (!HasColumn("jobs", column.c_str()))
        throw Error(ErrorCode::kCorrupt, "journal " + path + ": its jobs table has no column `" +
                                             column + "` (damaged); it is left as it is");
      start = end + 1;
    }
  } catch (...) {
    sqlite3_close(db_);
    db_ = nullptr;
    throw;
  }
}

bool Journal::HasColumn(const char* table, const char* column) const {
  Statement st(db_, "SELECT count(*) FROM pragma_table_info(?) WHERE name = ?", path_);
  st.Bind(1, std::string(table)).Bind(2, std::string(column));
  return st.Step() && st.Int(0) > 0;
}

int64_t Journal::Int(const char* sql) const {
  Statement st(db_, sql, path_);
  return st.Step() ? st.Int(0) : 0;
}

void Journal::UpgradeToVersion1() {
  Transaction upgrade(*this);
  // Journals from before jobs had an owner or a submitter (owner empty: anyone may cancel;
  // submitter uid -1: unknown, the coordinator attributes such jobs to its operator), and
  // statistics from before evaluation (eval_loss NULL: no eval that step).
  if (!HasColumn("jobs", "owner")) Exec("ALTER TABLE jobs ADD COLUMN owner TEXT");
  if (!HasColumn("jobs", "submitter_uid")) {
    Exec("ALTER TABLE jobs ADD COLUMN submitter_uid INTEGER DEFAULT -1");
    Exec("ALTER TABLE jobs ADD COLUMN submitter TEXT DEFAULT ''");
  }
  if (!HasColumn("stats", "eval_loss")) {
    Exec("ALTER TABLE stats ADD COLUMN eval_loss REAL");
    Exec("ALTER TABLE stats ADD COLUMN eval_tokens INTEGER");
  }
  Exec("ALTER TABLE jobs ADD COLUMN spec TEXT");
  {
    Statement rows(db_, "SELECT id, spec_blob, spec_toml, spec_source, priority FROM jobs", path_);
    while (rows.Step()) {
      const int64_t id = rows.Int(0);
      const JobSpec spec =
          Version0Spec(rows.Text(1), rows.Text(2), rows.Text(3), rows.Int(4),
                       "journal " + path_ + " (version 0): job " + std::to_string(id));
      Statement update(db_, "UPDATE jobs SET spec = ? WHERE id = ?", path_);
      update.Bind(1, JobSpecToToml(spec)).Bind(2, id);
      update.Step();
    }
  }
  Exec("ALTER TABLE jobs DROP COLUMN spec_blob");
  Exec("PRAGMA user_version = 1");
  upgrade.Commit();
  LS_LOG_INFO("journal {}: upgraded from version 0 to 1", path_);
}

std::string Journal::RecordProblem(const JobSpec& spec) {
  try {
    const JobSpec back = ParseJobSpec(JobSpecToToml(spec), spec.source);
    if (SerializePayload(back) == SerializePayload(spec)) return "";
    return "it holds a value that a job file cannot (a seed or a memory budget over 2^63, or a "
           "memory budget together with \"auto\")";
  } catch (const std::exception& e) {
    return e.what();
  }
}

Journal::~Journal() {
  if (db_ && sqlite3_close(db_) != SQLITE_OK)
    LS_LOG_WARN("journal {}: close failed: {}", path_, sqlite3_errmsg(db_));
}

Journal::Journal(Journal&& other) noexcept
    : lock_(std::move(other.lock_)),
      db_(std::exchange(other.db_, nullptr)),
      path_(std::move(other.path_)) {}

Journal& Journal::operator=(Journal&& other) noexcept {
  if (this != &other) {
    if (db_) sqlite3_close(db_);
    db_ = std::exchange(other.db_, nullptr);
    lock_ = std::move(other.lock_);
    path_ = std::move(other.path_);
  }
  return *this;
}

void Journal::Exec(const char* sql) const {
  char* err = nullptr;
  if (sqlite3_exec(db_, sql, nullptr, nullptr, &err) != SQLITE_OK) {
    std::string msg = err ? err : "unknown";
    sqlite3_free(err);
    throw Error(ErrorCode::kCorrupt, "journal " + path_ + ": " + msg);
  }
}

void Journal::SaveJob(const JobRecord& job) {
  const JobSummary& s = job.summary;
  Statement st(db_,
               (std::string("INSERT OR REPLACE INTO jobs (") + kJobColumns +
                ") VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)")
                   .c_str(),
               path_);
  st.Bind(1, s.id).Bind(2, s.name).Bind(3, static_cast<int64_t>(s.state)).Bind(4, s.reason);
  st.Bind(5, static_cast<int64_t>(s.priority)).Bind(6, s.store_name).Bind(7, s.fingerprint);
  st.Bind(8, s.spec_source).Bind(9, job.spec_toml).Bind(10, JobSpecToToml(job.spec));
  st.Bind(11, s.output_dir);
  st.Bind(12, s.adapter_path).Bind(13, s.worker_id).Bind(14, s.worker_host);
  st.Bind(15, s.worker_device).Bind(16, static_cast<int64_t>(s.attempt));
  st.Bind(17, static_cast<int64_t>(job.retries)).Bind(18, s.step).Bind(19, s.total_steps);
  st.Bind(20, s.checkpoint_step).Bind(21, s.checkpoint_path);
  st.Bind(22, static_cast<int64_t>(s.cancel_requested)).Bind(23, s.submitted_at);
  st.Bind(24, s.started_at).Bind(25, s.finished_at).Bind(26, job.owner);
  st.Bind(27, s.submitter_uid).Bind(28, s.submitter);
  st.Step();
}

int64_t Journal::MaxJobId() const { return Int("SELECT max(id) FROM jobs"); }

std::vector<JobRecord> Journal::LoadJobs(std::vector<std::string>* skipped) const {
  Statement st(db_, (std::string("SELECT ") + kJobColumns + " FROM jobs ORDER BY id").c_str(),
               path_);
  std::vector<JobRecord> jobs;
  const auto skip = [&](int64_t id, const std::string& why) {
    const std::string msg =
        "journal " + path_ + ": job " + std::to_string(id) +
        " skipped (not loaded, never dispatched; its row is left as it is): " + why;
    LS_LOG_ERROR("{}", msg);
    if (skipped) skipped->push_back(msg);
  };
  while (st.Step()) {
    JobRecord job;
    JobSummary& s = job.summary;
    s.id = st.Int(0);
    s.name = st.Text(1);
    int64_t state = st.Int(2);
    if (state < 0 || state > static_cast<int64_t>(JobState::kCancelled)) {
      skip(s.id, "it has state " + std::to_string(state));
      continue;
    }
    s.state = static_cast<JobState>(state);
    s.reason = st.Text(3);
    s.priority = static_cast<int32_t>(st.Int(4));
    s.store_name = st.Text(5);
    s.fingerprint = st.Text(6);
    s.spec_source = st.Text(7);
    job.spec_toml = st.Text(8);
    if (st.IsNull(9)) {
      skip(s.id, "it has no spec (NULL)");
      continue;
    }
    try {
      job.spec = ParseJobSpec(st.Text(9), s.spec_source);
      // A spec column written in the [flux]-only form for a job written in the shared form
      // (as journals of earlier builds hold every FLUX.1 job): the form from the job file's
      // text, so that its messages name the keys as the file writes them.
      if (job.spec.is_flux && !job.spec.flux.shared_form)
        job.spec.flux.shared_form = IsSharedFormFluxJobText(job.spec_toml);
    } catch (const std::exception& e) {
      skip(s.id, std::string("its spec cannot be read: ") + e.what());
      continue;
    }
    s.output_dir = st.Text(10);
    s.adapter_path = st.Text(11);
    s.worker_id = st.Text(12);
    s.worker_host = st.Text(13);
    s.worker_device = st.Text(14);
    s.attempt = static_cast<int32_t>(st.Int(15));
    job.retries = static_cast<int32_t>(st.Int(16));
    s.step = st.Int(17);
    s.total_steps = st.Int(18);
    s.checkpoint_step = st.Int(19);
    s.checkpoint_path = st.Text(20);
    s.cancel_requested = st.Int(21) != 0;
    s.submitted_at = st.Real(22);
    s.started_at = st.Real(23);
    s.finished_at = st.Real(24);
    job.owner = st.Text(25);
    s.submitter_uid = st.Int(26);
    s.submitter = st.Text(27);
    jobs.push_back(std::move(job));
  }
  return jobs;
}

void Journal::AppendStats(int64_t job_id, int32_t attempt, const StepStats& x) {
  Statement st(db_,
               "INSERT OR REPLACE INTO stats (job_id, step, attempt, total_steps, loss,"
               " learning_rate, grad_norm, tokens, step_seconds, tokens_per_second, h2d_bytes,"
               " h2d_busy_seconds, stall_seconds, copies, copies_saved, peak_device_bytes,"
               " eval_loss, eval_tokens) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
               path_);
  st.Bind(1, job_id).Bind(2, x.step).Bind(3, static_cast<int64_t>(attempt));
  st.Bind(4, x.total_steps).Bind(5, x.loss).Bind(6, x.learning_rate).Bind(7, x.grad_norm);
  st.Bind(8, x.tokens).Bind(9, x.step_seconds).Bind(10, x.tokens_per_second);
  st.Bind(11, static_cast<int64_t>(x.h2d_bytes)).Bind(12, x.h2d_busy_seconds);
  st.Bind(13, x.stall_seconds).Bind(14, x.copies).Bind(15, x.copies_saved);
  st.Bind(16, static_cast<int64_t>(x.peak_device_bytes));
  st.BindOptional(17, x.eval_loss).Bind(18, x.eval_tokens);
  st.Step();
}

std::vector<StepStats> Journal::LoadStats(int64_t job_id) const {
  Statement st(db_,
               "SELECT step, total_steps, loss, learning_rate, grad_norm, tokens, step_seconds,"
               " tokens_per_second, h2d_bytes, h2d_busy_seconds, stall_seconds, copies,"
               " copies_saved, peak_device_bytes, eval_loss, eval_tokens FROM stats"
               " WHERE job_id = ? ORDER BY step",
               path_);
  st.Bind(1, job_id);
  std::vector<StepStats> out;
  while (st.Step()) {
    StepStats x;
    x.step = st.Int(0);
    x.total_steps = st.Int(1);
    x.loss = st.Real(2);
    x.learning_rate = st.Real(3);
    x.grad_norm = st.Real(4);
    x.tokens = st.Int(5);
    x.step_seconds = st.Real(6);
    x.tokens_per_second = st.Real(7);
    x.h2d_bytes = static_cast<uint64_t>(st.Int(8));
    x.h2d_busy_seconds = st.Real(9);
    x.stall_seconds = st.Real(10);
    x.copies = st.Int(11);
    x.copies_saved = st.Int(12);
    x.peak_device_bytes = static_cast<uint64_t>(st.Int(13));
    x.eval_loss = st.OptionalReal(14);
    x.eval_tokens = st.Int(15);
    out.push_back(x);
  }
  return out;
}

}  // namespace lorastream::coordinator
