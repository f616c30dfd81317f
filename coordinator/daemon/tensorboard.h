// TensorBoard event files from the coordinator's step statistics: `lorastream coordinator
// --tensorboard DIR` writes one run (folder) per job, DIR/job-<id>-<sanitized name>/, so that
// `tensorboard --logdir DIR` shows every job's curves live. Torch-free and protobuf-free: the
// few messages needed are encoded by hand.
//
// File format (what TensorBoard's reader expects): events.out.tfevents.<unix s>.<host>, a
// sequence of TFRecords
//   uint64 length (little-endian) | uint32 masked CRC32C of those 8 bytes | data[length] |
//   uint32 masked CRC32C of data,   masked(c) = ((c >> 15) | (c << 17)) + 0xa282ead8
// each holding an Event protobuf: wall_time (double, field 1), step (int64, field 2), and
// either file_version (string, field 3; "brain.Event:2", the first record) or summary
// (Summary, field 5) = repeated Value (field 1) {tag (string, field 1), simple_value (float,
// field 2)}. Every record is flushed as it is written.
//
// Scalars per step (step = optimizer step): train/loss, train/learning_rate, train/grad_norm,
// perf/tokens_per_second, perf/stall_seconds, perf/h2d_gb_per_s (bytes / copy-busy time),
// perf/peak_memory_gib, and eval/loss on the steps that evaluated.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/posix/unique_fd.h"
#include "common/protocol/messages.h"

namespace lorastream::coordinator {

uint32_t Crc32c(const void* data, size_t size);
uint32_t MaskedCrc32c(const void* data, size_t size);

// One TFRecord around `data`.
std::string FrameRecord(const std::string& data);
// Event protobufs.
std::string EncodeFileVersionEvent(double wall_time);
std::string EncodeScalarsEvent(double wall_time, int64_t step,
                               const std::vector<std::pair<std::string, float>>& scalars);

// The scalars TensorBoard shows for one step report.
std::vector<std::pair<std::string, float>> StepScalars(const StepStats& stats);

// "job-12-my_job": the run folder of a job (characters other than [A-Za-z0-9._-] become '_').
std::string RunName(int64_t job_id, const std::string& job_name);

// One event file, created (and its file_version record written) at construction in a run
// folder that is created without following a link and must be this process's user's.
class EventFileWriter {
 public:
  explicit EventFileWriter(const std::string& run_dir);
  EventFileWriter(const EventFileWriter&) = delete;
  EventFileWriter& operator=(const EventFileWriter&) = delete;
  void Write(const std::string& event);  // framed and flushed; Error(kIo) when it fails
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  UniqueFd fd_;
};

class TensorBoardWriter {
 public:
  // Creates `dir` when missing and checks that it can write there: Error(kInvalidArgument)
  // naming the folder and the reason, so that a bad --tensorboard fails at start.
  explicit TensorBoardWriter(std::string dir);
  // Appends the step's scalars to the job's run (opening it on the job's first report).
  void Write(const JobSummary& job, const StepStats& stats);
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
  std::map<int64_t, std::unique_ptr<EventFileWriter>> runs_;
};

}  // namespace lorastream::coordinator
