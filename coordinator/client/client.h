// A DEALER connection to the coordinator: one request, one reply, matched by request id.
// Used by the `lorastream` command and by the worker agent. Not thread-safe (one caller at a
// time; the worker agent serializes its threads through a mutex).
#pragma once

#include <memory>
#include <string>

#include "common/protocol/messages.h"

namespace lorastream::client {

struct ClientOptions {
  std::string endpoint;             // e.g. tcp://127.0.0.1:5757
  std::string curve_keys_dir;       // "": plain; else coordinator.pub + ROLE.* from keygen
  int timeout_ms = 10000;           // per request; the coordinator answers in milliseconds
  std::string key_role = "client";  // "client" | "worker": the key pair presented
};

class Client {
 public:
  explicit Client(ClientOptions options);
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // Sends `request`, waits for its reply. Throws the coordinator's ErrorReply as Error(code),
  // Error(kTimeout) when no reply comes (naming the endpoint and the likely causes),
  // Error(kRefused) when the CURVE handshake was rejected.
  template <class Request>
  typename MessageTraits<Request>::Reply Call(const Request& request, int timeout_ms = -1) {
    using Reply = typename MessageTraits<Request>::Reply;
    uint32_t id = NextRequestId();
    std::string frame = Exchange(EncodeMessage(request, id), id, timeout_ms);
    Envelope env = DecodeEnvelope(frame.data(), frame.size());
    RaiseIfError(env);
    return DecodeMessage<Reply>(env);
  }

  // Sends arbitrary bytes; returns the raw reply frame whose request id is `request_id`
  // (tests that throw garbage at the daemon).
  std::string Exchange(const std::string& frame, uint32_t request_id, int timeout_ms = -1);

  // Drops the socket and connects a new one (after a timeout, so that a late reply or a
  // queued request does not linger).
  void Reconnect();

  const std::string& endpoint() const;

 private:
  uint32_t NextRequestId();
  static void RaiseIfError(const Envelope& env);
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace lorastream::client
