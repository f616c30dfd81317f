#include "coordinator/daemon/tensorboard.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "common/base/error.h"
#include "common/base/log.h"
#include "common/posix/durable_file.h"
#include "common/posix/user_access.h"

namespace lorastream::coordinator {

namespace fs = std::filesystem;

namespace {

// CRC-32C (Castagnoli, reflected polynomial 0x82f63b78), table-driven.
const std::array<uint32_t, 256>& Crc32cTable() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82f63b78u : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  return table;
}

void PutVarint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

template <class T>
void PutLittleEndian(std::string& out, T v) {
  char bytes[sizeof(T)];
  std::memcpy(bytes, &v, sizeof(T));  // the project targets little-endian hosts
  out.append(bytes, sizeof(T));
}

// Field keys: (field number << 3) | wire type (0 varint, 1 fixed64, 2 bytes, 5 fixed32).
void PutBytesField(std::string& out, int field, const std::string& bytes) {
  PutVarint(out, static_cast<uint64_t>(field) << 3 | 2);
  PutVarint(out, bytes.size());
  out += bytes;
}

std::string EventHeader(double wall_time, int64_t step) {
  std::string e;
  PutVarint(e, 1 << 3 | 1);
  PutLittleEndian(e, wall_time);
  if (step != 0) {
    PutVarint(e, 2 << 3 | 0);
    PutVarint(e, static_cast<uint64_t>(step));
  }
  return e;
}

double UnixSeconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

uint32_t Crc32c(const void* data, size_t size) {
  const auto& table = Crc32cTable();
  const auto* p = static_cast<const uint8_t*>(data);
  uint32_t c = 0xffffffffu;
  for (size_t i = 0; i < size; ++i) c = table[(c ^ p[i]) & 0xff] ^ (c >> 8);
  return c ^ 0xffffffffu;
}

uint32_t MaskedCrc32c(const void* data, size_t size) {
  const uint32_t c = Crc32c(data, size);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

std::string FrameRecord(const std::string& data) {
  std::string out;
  const uint64_t length = data.size();
  PutLittleEndian(out, length);
  PutLittleEndian(out, MaskedCrc32c(out.data(), 8));
  out += data;
  PutLittleEndian(out, MaskedCrc32c(data.data(), data.size()));
  return out;
}

std::string EncodeFileVersionEvent(double wall_time) {
  std::string e = EventHeader(wall_time, 0);
  PutBytesField(e, 3, "brain.Event:2");
  return e;
}

std::string EncodeScalarsEvent(double wall_time, int64_t step,
                               const std::vector<std::pair<std::string, float>>& scalars) {
  std::string summary;
  for (const auto& [tag, value] : scalars) {
    std::string v;
    PutBytesField(v, 1, tag);
    PutVarint(v, 2 << 3 | 5);
    PutLittleEndian(v, value);
    PutBytesField(summary, 1, v);
  }
  std::string e = EventHeader(wall_time, step);
  PutBytesField(e, 5, summary);
  return e;
}

std::vector<std::pair<std::string, float>> StepScalars(const StepStats& s) {
  std::vector<std::pair<std::string, float>> v = {
      {"train/loss", static_cast<float>(s.loss)},
      {"train/learning_rate", static_cast<float>(s.learning_rate)},
      {"train/grad_norm", static_cast<float>(s.grad_norm)},
      {"perf/tokens_per_second", static_cast<float>(s.tokens_per_second)},
      {"perf/stall_seconds", static_cast<float>(s.stall_seconds)},
      {"perf/h2d_gb_per_s",
       static_cast<float>(s.h2d_busy_seconds > 0 ? s.h2d_bytes / s.h2d_busy_seconds / 1e9 : 0.0)},
      {"perf/peak_memory_gib", static_cast<float>(s.peak_device_bytes / 1073741824.0)}};
  if (s.has_eval()) v.emplace_back("eval/loss", static_cast<float>(s.eval_loss));
  return v;
}

std::string RunName(int64_t job_id, const std::string& job_name) {
  std::string name = job_name.substr(0, 64);
  for (char& c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    if (!ok) c = '_';
  }
  if (name.empty() || name == "." || name == "..") name = "job";
  return "job-" + std::to_string(job_id) + "-" + name;
}

EventFileWriter::EventFileWriter(const std::string& run_dir) {
  // The run folder and its event file are created, never followed: a link (or another user's
  // folder) placed under the job's run name in a shared --tensorboard folder is refused, not
  // written through.
  if (::mkdir(run_dir.c_str(), 0755) != 0 && errno != EEXIST)
    ThrowErrno("tensorboard: cannot create " + run_dir);
  UniqueFd dir(::open(run_dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (!dir.valid())
    ThrowErrno("tensorboard: " + run_dir + " is not a folder this coordinator made (a link?)");
  struct stat st {};
  if (::fstat(dir.get(), &st) != 0) ThrowErrno("tensorboard: cannot inspect " + run_dir);
  if (st.st_uid != ::geteuid())
    throw Error(ErrorCode::kRefused, "tensorboard: " + run_dir + " belongs to " +
                                         DescribeUser(st.st_uid) + ", not to this coordinator's " +
                                         DescribeUser(::geteuid()) + "; remove it");
  char host[256] = "localhost";
  gethostname(host, sizeof host - 1);
  const double now = UnixSeconds();
  // The pid keeps two coordinators' files (a restart within one second) apart.
  const std::string name = "events.out.tfevents." + std::to_string(static_cast<int64_t>(now)) +
                           "." + host + "." + std::to_string(getpid());
  path_ = (fs::path(run_dir) / name).string();
  fd_ = UniqueFd(::openat(dir.get(), name.c_str(),
                          O_WRONLY | O_CREAT | O_EXCL | O_APPEND | O_NOFOLLOW | O_CLOEXEC, 0644));
  if (!fd_.valid()) ThrowErrno("tensorboard: cannot create " + path_);
  Write(EncodeFileVersionEvent(now));
}

void EventFileWriter::Write(const std::string& event) {
  // One write per record, unbuffered: TensorBoard reads the file while it grows.
  const std::string record = FrameRecord(event);
  WriteAll(fd_.get(), record.data(), record.size(), "tensorboard: " + path_);
}

TensorBoardWriter::TensorBoardWriter(std::string dir) : dir_(std::move(dir)) {
  if (dir_.empty())
    throw Error(ErrorCode::kInvalidArgument, "--tensorboard: give a folder to write runs into");
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec || !fs::is_directory(dir_, ec))
    throw Error(ErrorCode::kInvalidArgument, "--tensorboard " + dir_ +
                                                 ": not a folder that can be created" +
                                                 (ec ? " (" + ec.message() + ")" : std::string()));
  if (access(dir_.c_str(), W_OK | X_OK) != 0)
    throw Error(ErrorCode::kInvalidArgument,
                "--tensorboard " + dir_ + ": cannot write there (" + std::strerror(errno) + ")");
  dir_ = fs::absolute(dir_).lexically_normal().string();
}

void TensorBoardWriter::Write(const JobSummary& job, const StepStats& stats) {
  auto it = runs_.find(job.id);
  if (it == runs_.end()) {
    const std::string run = (fs::path(dir_) / RunName(job.id, job.name)).string();
    it = runs_.emplace(job.id, std::make_unique<EventFileWriter>(run)).first;
    LS_LOG_INFO("tensorboard: job {} writes {}", job.id, it->second->path());
  }
  it->second->Write(EncodeScalarsEvent(UnixSeconds(), stats.step, StepScalars(stats)));
}

}  // namespace lorastream::coordinator
