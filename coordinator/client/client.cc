#include "coordinator/client/client.h"

#include <chrono>
#include <zmq.hpp>

#include "coordinator/client/curve.h"

namespace lorastream::client {

struct Client::Impl {
  ClientOptions options;
  zmq::context_t context;
  std::unique_ptr<zmq::socket_t> socket;
  std::unique_ptr<zmq::socket_t> monitor;  // handshake failures (CURVE refused)
  CurveClientKeys keys;
  bool curve = false;
  uint32_t next_id = 1;
  int monitor_seq = 0;

  void Connect() {
    socket = std::make_unique<zmq::socket_t>(context, zmq::socket_type::dealer);
    socket->set(zmq::sockopt::linger, 0);
    socket->set(zmq::sockopt::maxmsgsize, static_cast<int64_t>(4 * kMaxPayloadBytes));
    if (curve) {
      socket->set(zmq::sockopt::curve_serverkey, keys.server_public_key);
      socket->set(zmq::sockopt::curve_publickey, keys.client.public_key);
      socket->set(zmq::sockopt::curve_secretkey, keys.client.secret_key);
    }
    std::string addr = "inproc://lorastream-client-monitor-" +
                       std::to_string(reinterpret_cast<uintptr_t>(this)) + "-" +
                       std::to_string(monitor_seq++);
    if (zmq_socket_monitor(socket->handle(), addr.c_str(),
                           ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL |
                               ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |
                               ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) == 0) {
      monitor = std::make_unique<zmq::socket_t>(context, zmq::socket_type::pair);
      monitor->set(zmq::sockopt::linger, 0);
      monitor->connect(addr);
    }
    try {
      socket->connect(options.endpoint);
    } catch (const zmq::error_t& e) {
      throw Error(ErrorCode::kInvalidArgument,
                  "cannot connect to '" + options.endpoint + "': " + e.what());
    }
  }

  // The default endpoint's folder, checked before every request: a request goes out only
  // while the folder is this user's own, over a connection made after such a check (a
  // socket connected while the folder was missing or another user's is dropped, so that
  // whoever answered there never gets a request).
  void CheckEndpointDir() {
    bool missing = false;
    std::string why = EndpointDirProblem(options.endpoint, &missing);
    if (why.empty() && !missing) return;
    monitor.reset();
    socket.reset();
    if (!why.empty())
      throw Error(ErrorCode::kRefused, "not connecting to " + options.endpoint + ": " + why);
    throw Error(ErrorCode::kTimeout, "no coordinator at " + options.endpoint + ": its folder " +
                                         DefaultRuntimeDir() +
                                         " does not exist (is `lorastream coordinator` running as "
                                         "this user?)");
  }

  // What the monitor saw of a handshake. Without CURVE a connection that closes before the
  // handshake completes says little: the coordinator is stopping or restarting (ZeroMQ
  // reconnects, and the request goes out once one is there), or it requires CURVE and closed
  // on seeing none (which ZeroMQ reports as a mismatch only when the coordinator's greeting
  // arrived first). Only a refused key or a mismatch it saw is surely about CURVE.
  enum class Handshake { kNone, kClosed, kKeyRefused, kFailed };
  Handshake HandshakeEvent() {
    zmq::message_t event;
    if (!monitor || !monitor->recv(event, zmq::recv_flags::dontwait)) return Handshake::kNone;
    zmq::message_t address;
    (void)monitor->recv(address, zmq::recv_flags::dontwait);
    uint16_t id = 0;
    if (event.size() >= 2) std::memcpy(&id, event.data(), 2);
    if (id == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) return Handshake::kKeyRefused;
    if (id == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL && !curve) return Handshake::kClosed;
    return Handshake::kFailed;
  }
};

Client::Client(ClientOptions options) : impl_(std::make_unique<Impl>()) {
  impl_->options = std::move(options);
  if (!impl_->options.curve_keys_dir.empty()) {
    impl_->keys = LoadClientKeys(impl_->options.curve_keys_dir, impl_->options.key_role);
    impl_->curve = true;
  }
  impl_->CheckEndpointDir();  // a folder that is not ours: refused before anything starts
}

Client::~Client() = default;

const std::string& Client::endpoint() const { return impl_->options.endpoint; }

uint32_t Client::NextRequestId() { return impl_->next_id++; }

void Client::Reconnect() {
  impl_->monitor.reset();
  impl_->socket.reset();  // connected again by the next request
}

std::string Client::Exchange(const std::string& frame, uint32_t request_id, int timeout_ms) {
  Impl& s = *impl_;
  if (timeout_ms < 0) timeout_ms = s.options.timeout_ms;
  // ZeroMQ would retry an ipc connect refused by permissions forever: say so at once.
  if (std::string why = IpcPermissionProblem(s.options.endpoint); !why.empty())
    throw Error(ErrorCode::kRefused, why);
  s.CheckEndpointDir();
  if (!s.socket) s.Connect();
  // The request goes out once the socket has a connection to queue it on: none for a while
  // when a handshake fails and ZeroMQ reconnects. Until then it waits for one as for the reply.
  bool queued = s.socket->send(zmq::buffer(frame), zmq::send_flags::dontwait).has_value();
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  bool closed = false;  // a connection closed before its handshake completed
  while (true) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) break;
    const short wanted = queued ? ZMQ_POLLIN : ZMQ_POLLOUT;
    zmq::pollitem_t items[] = {{s.socket->handle(), 0, wanted, 0},
                               {s.monitor ? s.monitor->handle() : nullptr, 0, ZMQ_POLLIN, 0}};
    zmq::poll(items, s.monitor ? 2 : 1, std::min(left, std::chrono::milliseconds(200)));
    if (s.monitor && (items[1].revents & ZMQ_POLLIN)) {
      const Impl::Handshake event = s.HandshakeEvent();
      if (event == Impl::Handshake::kClosed) closed = true;
      if (event == Impl::Handshake::kKeyRefused || event == Impl::Handshake::kFailed) {
        Reconnect();
        throw Error(ErrorCode::kRefused,
                    s.options.endpoint + (event == Impl::Handshake::kKeyRefused
                                              ? ": the coordinator refused this client's CURVE key"
                                              : ": the security handshake with the coordinator "
                                                "failed (CURVE keys required, or mismatched)"));
      }
    }
    if (!queued) {
      if (items[0].revents & ZMQ_POLLOUT)
        queued = s.socket->send(zmq::buffer(frame), zmq::send_flags::dontwait).has_value();
      continue;
    }
    if (!(items[0].revents & ZMQ_POLLIN)) continue;
    zmq::message_t reply;
    if (!s.socket->recv(reply, zmq::recv_flags::dontwait)) continue;
    std::optional<uint32_t> id = PeekRequestId(reply.data(), reply.size());
    if (id && *id == request_id) return reply.to_string();
    // A late reply to an earlier request that timed out: drop it.
  }
  Reconnect();  // forget the unanswered request so it is not delivered later
  const std::string unreachable = "cannot reach the coordinator at " + s.options.endpoint +
                                  " within " + std::to_string(timeout_ms) + " ms: ";
  if (closed)
    throw Error(ErrorCode::kTimeout,
                unreachable +
                    "it closed each connection before answering (it is stopping or "
                    "restarting; or it was started with --curve-keys and this client has no "
                    "keys)");
  if (!queued)
    throw Error(ErrorCode::kTimeout,
                unreachable +
                    "no connection took the request (is `lorastream coordinator` running "
                    "there? does it need --curve-keys?)");
  throw Error(ErrorCode::kTimeout,
              "no reply from the coordinator at " + s.options.endpoint + " within " +
                  std::to_string(timeout_ms) +
                  " ms (is `lorastream coordinator` running there? does it need "
                  "--curve-keys?)");
}

void Client::RaiseIfError(const Envelope& env) {
  if (env.header.type == static_cast<uint16_t>(MessageType::kError)) {
    ErrorReply e = DecodeMessage<ErrorReply>(env);
    throw Error(e.code == ErrorCode::kOk ? ErrorCode::kProtocol : e.code, e.message);
  }
}

}  // namespace lorastream::client
