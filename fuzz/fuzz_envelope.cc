// libFuzzer target for the protocol decoder: any frame must either decode or throw
// lorastream::Error; a frame that decodes must re-encode to the same bytes (the codec is a
// bijection on valid frames, so nothing is silently reinterpreted).
#include <cstdint>
#include <cstdlib>
#include <string>

#include "common/protocol/messages.h"

using namespace lorastream;

namespace {

template <class T>
void Check(const Envelope& env, const uint8_t* data, size_t size) {
  T message = DecodeMessage<T>(env);
  std::string again = EncodeMessage(message, env.header.request_id);
  if (again.size() != size ||
      again.compare(0, size, reinterpret_cast<const char*>(data), size) != 0)
    std::abort();
}

void DecodeAny(const Envelope& env, const uint8_t* data, size_t size) {
  switch (static_cast<MessageType>(env.header.type)) {
    case MessageType::kError:
      return Check<ErrorReply>(env, data, size);
    case MessageType::kRegister:
      return Check<RegisterRequest>(env, data, size);
    case MessageType::kRegisterReply:
      return Check<RegisterReply>(env, data, size);
    case MessageType::kHeartbeat:
      return Check<HeartbeatRequest>(env, data, size);
    case MessageType::kHeartbeatReply:
      return Check<HeartbeatReply>(env, data, size);
    case MessageType::kStepReport:
      return Check<StepReport>(env, data, size);
    case MessageType::kCheckpointReport:
      return Check<CheckpointReport>(env, data, size);
    case MessageType::kJobFinished:
      return Check<JobFinished>(env, data, size);
    case MessageType::kWorkerAck:
      return Check<WorkerAck>(env, data, size);
    case MessageType::kSubmit:
      return Check<SubmitRequest>(env, data, size);
    case MessageType::kSubmitReply:
      return Check<SubmitReply>(env, data, size);
    case MessageType::kListJobs:
      return Check<ListJobsRequest>(env, data, size);
    case MessageType::kListJobsReply:
      return Check<ListJobsReply>(env, data, size);
    case MessageType::kShowJob:
      return Check<ShowJobRequest>(env, data, size);
    case MessageType::kShowJobReply:
      return Check<ShowJobReply>(env, data, size);
    case MessageType::kStats:
      return Check<StatsRequest>(env, data, size);
    case MessageType::kStatsReply:
      return Check<StatsReply>(env, data, size);
    case MessageType::kCancel:
      return Check<CancelRequest>(env, data, size);
    case MessageType::kCancelReply:
      return Check<CancelReply>(env, data, size);
    case MessageType::kListWorkers:
      return Check<ListWorkersRequest>(env, data, size);
    case MessageType::kListWorkersReply:
      return Check<ListWorkersReply>(env, data, size);
    case MessageType::kWatch:
      return Check<WatchRequest>(env, data, size);
    case MessageType::kWatchReply:
      return Check<WatchReply>(env, data, size);
  }
  CheckMessageType(env, MessageType::kError);  // unknown type: must throw kProtocol
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    Envelope env = DecodeEnvelope(data, size);
    DecodeAny(env, data, size);
  } catch (const Error&) {
  }
  return 0;
}
