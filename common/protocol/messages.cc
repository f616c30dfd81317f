#include "common/protocol/messages.h"

namespace lorastream {

const char* MessageTypeName(uint16_t type) {
  switch (static_cast<MessageType>(type)) {
    case MessageType::kError:
      return "Error";
    case MessageType::kRegister:
      return "Register";
    case MessageType::kRegisterReply:
      return "RegisterReply";
    case MessageType::kHeartbeat:
      return "Heartbeat";
    case MessageType::kHeartbeatReply:
      return "HeartbeatReply";
    case MessageType::kStepReport:
      return "StepReport";
    case MessageType::kCheckpointReport:
      return "CheckpointReport";
    case MessageType::kJobFinished:
      return "JobFinished";
    case MessageType::kWorkerAck:
      return "WorkerAck";
    case MessageType::kSubmit:
      return "Submit";
    case MessageType::kSubmitReply:
      return "SubmitReply";
    case MessageType::kListJobs:
      return "ListJobs";
    case MessageType::kListJobsReply:
      return "ListJobsReply";
    case MessageType::kShowJob:
      return "ShowJob";
    case MessageType::kShowJobReply:
      return "ShowJobReply";
    case MessageType::kStats:
      return "Stats";
    case MessageType::kStatsReply:
      return "StatsReply";
    case MessageType::kCancel:
      return "Cancel";
    case MessageType::kCancelReply:
      return "CancelReply";
    case MessageType::kListWorkers:
      return "ListWorkers";
    case MessageType::kListWorkersReply:
      return "ListWorkersReply";
    case MessageType::kWatch:
      return "Watch";
    case MessageType::kWatchReply:
      return "WatchReply";
  }
  return "unknown";
}

bool IsKnownMessageType(uint16_t type) { return std::string(MessageTypeName(type)) != "unknown"; }

const char* JobStateName(JobState state) {
  switch (state) {
    case JobState::kQueued:
      return "queued";
    case JobState::kRunning:
      return "running";
    case JobState::kSucceeded:
      return "succeeded";
    case JobState::kFailed:
      return "failed";
    case JobState::kCancelled:
      return "cancelled";
  }
  return "unknown";
}

bool IsTerminal(JobState state) {
  return state == JobState::kSucceeded || state == JobState::kFailed ||
         state == JobState::kCancelled;
}

void CheckMessageType(const Envelope& envelope, MessageType expected) {
  uint16_t type = envelope.header.type;
  if (!IsKnownMessageType(type))
    throw Error(ErrorCode::kProtocol, "unknown message type " + std::to_string(type));
  if (type != static_cast<uint16_t>(expected))
    throw Error(ErrorCode::kProtocol, std::string("expected a ") +
                                          MessageTypeName(static_cast<uint16_t>(expected)) +
                                          " message, got " + MessageTypeName(type));
}

void ThrowTrailing(const Envelope& envelope, size_t left) {
  throw Error(ErrorCode::kCorrupt, std::string("message ") + MessageTypeName(envelope.header.type) +
                                       ": " + std::to_string(left) +
                                       " unexpected bytes after the last field");
}

}  // namespace lorastream
