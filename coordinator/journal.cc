#include "coordinator/journal.h"

#include <fcntl.h>
#include <sqlite3.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <limits>
#include <utility>

#include "common/error.h"
#include "common/log.h"

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

constexpr const char* kSchema = R"sql(
CREATE TABLE IF NOT EXISTS jobs (
  id INTEGER PRIMARY KEY, name TEXT, state INTEGER, reason TEXT, priority INTEGER,
  store_name TEXT, fingerprint TEXT, spec_source TEXT, spec_toml TEXT, spec_blob BLOB, output_dir TEXT,
  adapter_path TEXT, worker_id TEXT, worker_host TEXT, worker_device TEXT, attempt INTEGER,
  retries INTEGER, step INTEGER, total_steps INTEGER, checkpoint_step INTEGER,
  checkpoint_path TEXT, cancel_requested INTEGER, submitted_at REAL, started_at REAL,
  finished_at REAL, owner TEXT, submitter_uid INTEGER, submitter TEXT);
CREATE TABLE IF NOT EXISTS stats (
  job_id INTEGER, step INTEGER, attempt INTEGER, total_steps INTEGER, loss REAL,
  learning_rate REAL, grad_norm REAL, tokens INTEGER, step_seconds REAL,
  tokens_per_second REAL, h2d_bytes INTEGER, h2d_busy_seconds REAL, stall_seconds REAL,
  copies INTEGER, copies_saved INTEGER, peak_device_bytes INTEGER, eval_loss REAL,
  eval_tokens INTEGER, PRIMARY KEY (job_id, step));
)sql";

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
  // WAL + synchronous=NORMAL: a committed transaction survives a crash of the coordinator
  // process (the WAL is in the OS page cache); only a power loss may drop the last ones.
  Exec("PRAGMA journal_mode=WAL");
  Exec("PRAGMA synchronous=NORMAL");
  Exec(kSchema);
  // Journals written before jobs had an owner or a submitter: add the columns (owner empty:
  // anyone may cancel; submitter uid -1: unknown, the coordinator attributes such jobs to its
  // operator). New columns go last, in this order, as SaveJob writes them.
  bool has_owner = false, has_submitter = false;
  {
    Statement st(db_, "SELECT name FROM pragma_table_info('jobs')", path_);
    while (st.Step()) {
      has_owner = has_owner || st.Text(0) == "owner";
      has_submitter = has_submitter || st.Text(0) == "submitter_uid";
    }
  }
  if (!has_owner) Exec("ALTER TABLE jobs ADD COLUMN owner TEXT");
  if (!has_submitter) {
    Exec("ALTER TABLE jobs ADD COLUMN submitter_uid INTEGER DEFAULT -1");
    Exec("ALTER TABLE jobs ADD COLUMN submitter TEXT DEFAULT ''");
  }
  // Journals written before evaluation: statistics gain eval_loss (NULL: no eval that step).
  bool has_eval = false;
  {
    Statement st(db_, "SELECT name FROM pragma_table_info('stats')", path_);
    while (st.Step()) has_eval = has_eval || st.Text(0) == "eval_loss";
  }
  if (!has_eval) {
    Exec("ALTER TABLE stats ADD COLUMN eval_loss REAL");
    Exec("ALTER TABLE stats ADD COLUMN eval_tokens INTEGER");
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
               "INSERT OR REPLACE INTO jobs VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,"
               "?,?,?,?,?,?)",
               path_);
  st.Bind(1, s.id).Bind(2, s.name).Bind(3, static_cast<int64_t>(s.state)).Bind(4, s.reason);
  st.Bind(5, static_cast<int64_t>(s.priority)).Bind(6, s.store_name).Bind(7, s.fingerprint);
  st.Bind(8, s.spec_source).Bind(9, job.spec_toml).BindBlob(10, SerializePayload(job.spec));
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

std::vector<JobRecord> Journal::LoadJobs() const {
  Statement st(db_, "SELECT * FROM jobs ORDER BY id", path_);
  std::vector<JobRecord> jobs;
  while (st.Step()) {
    JobRecord job;
    JobSummary& s = job.summary;
    s.id = st.Int(0);
    s.name = st.Text(1);
    int64_t state = st.Int(2);
    if (state < 0 || state > static_cast<int64_t>(JobState::kCancelled))
      throw Error(ErrorCode::kCorrupt, "journal " + path_ + ": job " + std::to_string(s.id) +
                                           " has state " + std::to_string(state));
    s.state = static_cast<JobState>(state);
    s.reason = st.Text(3);
    s.priority = static_cast<int32_t>(st.Int(4));
    s.store_name = st.Text(5);
    s.fingerprint = st.Text(6);
    s.spec_source = st.Text(7);
    job.spec_toml = st.Text(8);
    job.spec = DeserializePayload<JobSpec>(
        st.Text(9), "journal " + path_ + ": job " + std::to_string(s.id) + " spec");
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
