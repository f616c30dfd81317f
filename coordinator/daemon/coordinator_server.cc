#include "coordinator/daemon/coordinator_server.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstring>
#include <deque>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "common/base/log.h"
#include "common/posix/user_access.h"
#include "common/protocol/messages.h"
#include "coordinator/client/curve.h"

namespace lorastream::coordinator {
namespace {

double SteadySeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Frames above this are dropped by libzmq (the peer is disconnected) before they reach us;
// between kMaxPayloadBytes and this they are received and answered with kProtocol.
constexpr int64_t kTransportCapBytes = 4 * static_cast<int64_t>(kMaxPayloadBytes);

// Whether something accepts connections on the unix socket `path` (a live coordinator:
// binding over it would silently steal its clients).
bool UnixSocketAnswers(const std::string& path) {
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path)) return false;
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  bool answers = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  ::close(fd);
  return answers;
}

// The uid in an ipc peer's "Peer-Address" property: libzmq (built with SO_PEERCRED, as
// Debian's is) appends ":uid:gid:pid" to the address of a unix-socket peer.
int64_t PeerUid(const char* peer_address) {
  if (!peer_address) return -1;
  std::string text = peer_address;
  size_t pid_colon = text.rfind(':');
  if (pid_colon == std::string::npos || pid_colon == 0) return -1;
  size_t gid_colon = text.rfind(':', pid_colon - 1);
  if (gid_colon == std::string::npos || gid_colon == 0) return -1;
  size_t uid_colon = text.rfind(':', gid_colon - 1);
  if (uid_colon == std::string::npos) return -1;
  std::string uid = text.substr(uid_colon + 1, gid_colon - uid_colon - 1);
  if (uid.empty() || uid.find_first_not_of("0123456789") != std::string::npos) return -1;
  return std::stoll(uid);
}

Submitter SubmitterOf(int64_t uid) {
  Submitter who;
  who.uid = uid;
  try {
    who.name = LookupUser(static_cast<uid_t>(uid)).name;
  } catch (const Error&) {
    who.name = "uid " + std::to_string(uid);
  }
  return who;
}

struct ParkedWatch {
  std::string identity;
  uint32_t request_id;
  WatchRequest request;
  double deadline;
  Submitter viewer;
};

bool IsWorkerMessage(MessageType type) {
  return type == MessageType::kRegister || type == MessageType::kHeartbeat ||
         type == MessageType::kStepReport || type == MessageType::kCheckpointReport ||
         type == MessageType::kJobFinished;
}

}  // namespace

struct CoordinatorServer::Impl {
  ServerOptions options;
  zmq::context_t context;
  zmq::socket_t router{context, zmq::socket_type::router};
  zmq::socket_t zap{context, zmq::socket_type::rep};
  bool curve = false;
  bool peer_credentials = false;  // ipc: the kernel tells each peer's uid
  client::CurveServerKeys keys;
  std::string endpoint;
  std::unique_ptr<Coordinator> core;
  std::deque<ParkedWatch> watches;
  uint64_t bad_messages = 0;

  void Send(const std::string& identity, const std::string& frame) {
    router.send(zmq::buffer(identity), zmq::send_flags::sndmore);
    router.send(zmq::buffer(frame), zmq::send_flags::dontwait);
  }
  void SendError(const std::string& identity, uint32_t request_id, ErrorCode code,
                 const std::string& message) {
    ErrorReply e{code, message};
    Send(identity, EncodeMessage(e, request_id));
  }
  void HandleFrames(std::vector<zmq::message_t>& frames);
  std::string Dispatch(const Envelope& env, const std::string& identity,
                       const std::string& client_key, const Submitter& who, double now);
  Submitter WhoSent(const zmq::message_t& frame, const char* client_key) const;
  void HandleZap();
  void AnswerWatches(double now, bool all);
};

CoordinatorServer::CoordinatorServer(ServerOptions options) : impl_(std::make_unique<Impl>()) {
  Impl& s = *impl_;
  s.options = std::move(options);
  bool local = client::IsLocalEndpoint(s.options.bind);
  if (!client::IsCredentialEndpoint(s.options.bind) && s.options.curve_keys_dir.empty() &&
      !s.options.insecure)
    throw Error(ErrorCode::kInvalidArgument,
                "binding " + s.options.bind + " without CURVE lets " +
                    (local ? "every user of this host" : "anyone who reaches it") +
                    " act as the operator: use the default endpoint (" + client::DefaultEndpoint() +
                    "), pass --curve-keys DIR (keys from `lorastream keygen`) or, knowingly, "
                    "--insecure");
  if (s.options.bind.rfind("ipc://", 0) == 0) {
    s.peer_credentials = true;
    const std::string path = s.options.bind.substr(6);
    if (path.rfind(client::DefaultRuntimeDir() + "/", 0) == 0) {
      client::EnsureOwnerOnlyDir(client::DefaultRuntimeDir());
    }
    if (UnixSocketAnswers(path))
      throw Error(ErrorCode::kRefused, "another coordinator listens on " + s.options.bind +
                                           "; stop it first or pass another --bind");
  }
  if (!s.options.curve_keys_dir.empty()) {
    s.keys = client::LoadServerKeys(s.options.curve_keys_dir);
    s.curve = true;
    // ZAP: libzmq asks this socket about every CURVE handshake; only listed keys pass.
    s.zap.bind("inproc://zeromq.zap.01");
    s.router.set(zmq::sockopt::curve_server, 1);
    s.router.set(zmq::sockopt::curve_secretkey, s.keys.server.secret_key);
    s.router.set(zmq::sockopt::zap_domain, "lorastream");
  }
  s.router.set(zmq::sockopt::linger, 0);
  s.router.set(zmq::sockopt::maxmsgsize, kTransportCapBytes);
  s.router.set(zmq::sockopt::router_mandatory, 0);
  s.router.set(zmq::sockopt::sndhwm, 100000);
  s.router.set(zmq::sockopt::rcvhwm, 100000);
  s.core =
      std::make_unique<Coordinator>(s.options.coordinator, Journal(s.options.db), SteadySeconds());
  try {
    s.router.bind(s.options.bind);
  } catch (const zmq::error_t& e) {
    throw Error(ErrorCode::kIo, "cannot bind " + s.options.bind + ": " + e.what());
  }
  s.endpoint = s.router.get(zmq::sockopt::last_endpoint);
  LS_LOG_INFO("coordinator listening on {} ({}), journal {}", s.endpoint,
              s.curve ? "CURVE, " + std::to_string(s.keys.authorized_clients.size()) +
                            " authorized client keys, " +
                            std::to_string(s.keys.authorized_workers.size()) + " worker keys"
                      : (s.peer_credentials ? "peers identified by uid, no CURVE"
                                            : "INSECURE: no CURVE, every client is the operator"),
              s.options.db);
}

CoordinatorServer::~CoordinatorServer() = default;

const std::string& CoordinatorServer::endpoint() const { return impl_->endpoint; }

void CoordinatorServer::Impl::HandleZap() {
  std::vector<zmq::message_t> frames;
  if (!zmq::recv_multipart(zap, std::back_inserter(frames), zmq::recv_flags::dontwait)) return;
  std::string version = frames.size() > 0 ? frames[0].to_string() : "";
  std::string request_id = frames.size() > 1 ? frames[1].to_string() : "";
  std::string mechanism = frames.size() > 5 ? frames[5].to_string() : "";
  std::string address = frames.size() > 3 ? frames[3].to_string() : "";
  bool ok = false;
  char z85_key[41] = {};
  if (mechanism == "CURVE" && frames.size() > 6 && frames[6].size() == 32) {
    zmq_z85_encode(z85_key, static_cast<const uint8_t*>(frames[6].data()), 32);
    ok = keys.authorized_clients.count(z85_key) > 0 || keys.authorized_workers.count(z85_key) > 0;
  }
  if (!ok) LS_LOG_WARN("refused a {} client from {}: key not authorized", mechanism, address);
  // The user id (the client's public key) reaches every message of the connection as its
  // "User-Id" property: the coordinator records who submitted a job.
  std::array<std::string, 6> reply = {version,
                                      request_id,
                                      ok ? "200" : "400",
                                      ok ? "OK" : "client key not authorized",
                                      ok ? std::string(z85_key) : "",
                                      ""};
  for (size_t i = 0; i < reply.size(); ++i)
    zap.send(zmq::buffer(reply[i]),
             i + 1 < reply.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
}

// The peer's uid on an ipc socket (the kernel's word); else the user its CURVE key maps to;
// else uid -1, which the coordinator attributes to its operator.
Submitter CoordinatorServer::Impl::WhoSent(const zmq::message_t& frame,
                                           const char* client_key) const {
  if (peer_credentials) {
    int64_t uid = PeerUid(zmq_msg_gets(frame.handle(), "Peer-Address"));
    if (uid >= 0) return SubmitterOf(uid);
  }
  if (client_key) {
    auto it = keys.key_users.find(client_key);
    if (it != keys.key_users.end()) {
      Submitter who;
      who.uid = LookupUser(it->second).uid;
      who.name = it->second;
      return who;
    }
  }
  return Submitter{};
}

std::string CoordinatorServer::Impl::Dispatch(const Envelope& env, const std::string& identity,
                                              const std::string& client_key, const Submitter& who,
                                              double now) {
  uint32_t rid = env.header.request_id;
  Coordinator& c = *core;
  // Under CURVE a worker's key is not a client's: only keys in authorized_workers take and
  // report on jobs, and they do nothing else.
  if (curve) {
    const bool worker_key = keys.authorized_workers.count(client_key) > 0;
    const auto type = static_cast<MessageType>(env.header.type);
    if (IsWorkerMessage(type) && !worker_key)
      throw Error(ErrorCode::kRefused,
                  std::string(MessageTypeName(env.header.type)) +
                      " refused: this key is not a worker's (workers present a key listed in "
                      "the coordinator's authorized_workers: worker.key from `lorastream "
                      "keygen`)");
    if (!IsWorkerMessage(type) && worker_key)
      throw Error(ErrorCode::kRefused,
                  std::string(MessageTypeName(env.header.type)) +
                      " refused: a worker's key is for workers only (use a client key)");
  }
  switch (static_cast<MessageType>(env.header.type)) {
    case MessageType::kRegister:
      return EncodeMessage(c.Register(DecodeMessage<RegisterRequest>(env), now), rid);
    case MessageType::kHeartbeat:
      return EncodeMessage(c.Heartbeat(DecodeMessage<HeartbeatRequest>(env), now), rid);
    case MessageType::kStepReport:
      return EncodeMessage(c.Step(DecodeMessage<StepReport>(env), now), rid);
    case MessageType::kCheckpointReport:
      return EncodeMessage(c.Checkpoint(DecodeMessage<CheckpointReport>(env), now), rid);
    case MessageType::kJobFinished:
      return EncodeMessage(c.Finished(DecodeMessage<JobFinished>(env), now), rid);
    case MessageType::kSubmit:
      return EncodeMessage(c.Submit(DecodeMessage<SubmitRequest>(env), client_key, who), rid);
    case MessageType::kListJobs:
      return EncodeMessage(c.ListJobs(DecodeMessage<ListJobsRequest>(env), now, who), rid);
    case MessageType::kShowJob:
      return EncodeMessage(c.ShowJob(DecodeMessage<ShowJobRequest>(env), now, who), rid);
    case MessageType::kStats:
      return EncodeMessage(c.Stats(DecodeMessage<StatsRequest>(env), who), rid);
    case MessageType::kCancel:
      return EncodeMessage(c.Cancel(DecodeMessage<CancelRequest>(env), client_key), rid);
    case MessageType::kListWorkers:
      return EncodeMessage(c.ListWorkers(DecodeMessage<ListWorkersRequest>(env), now), rid);
    case MessageType::kWatch: {
      WatchRequest req = DecodeMessage<WatchRequest>(env);
      WatchReply reply = c.Watch(req, now, who);  // validates the job ids before parking
      if (reply.version > req.since_version || req.wait_ms <= 0) return EncodeMessage(reply, rid);
      double wait = std::min(req.wait_ms, 60000) / 1000.0;
      watches.push_back(ParkedWatch{identity, rid, std::move(req), now + wait, who});
      return "";
    }
    default:
      break;
  }
  if (IsKnownMessageType(env.header.type))
    throw Error(ErrorCode::kProtocol,
                std::string(MessageTypeName(env.header.type)) + " is not a request");
  throw Error(ErrorCode::kProtocol, "unknown message type " + std::to_string(env.header.type));
}

void CoordinatorServer::Impl::HandleFrames(std::vector<zmq::message_t>& frames) {
  if (frames.empty()) return;
  std::string identity = frames[0].to_string();
  uint32_t rid = 0;
  ErrorCode code = ErrorCode::kOk;
  std::string message;
  if (frames.size() != 2) {
    code = ErrorCode::kProtocol;
    message = "expected one frame per message, got " + std::to_string(frames.size() - 1);
  } else {
    const zmq::message_t& frame = frames[1];
    rid = PeekRequestId(frame.data(), frame.size()).value_or(0);
    try {
      Envelope env = DecodeEnvelope(frame.data(), frame.size());
      // Set by our ZAP handler under CURVE; absent otherwise (zmq_msg_gets then fails).
      const char* user = curve ? zmq_msg_gets(frame.handle(), "User-Id") : nullptr;
      std::string reply =
          Dispatch(env, identity, user ? user : "", WhoSent(frame, user), SteadySeconds());
      if (!reply.empty()) Send(identity, reply);
      return;
    } catch (const Error& e) {
      code = e.code();
      message = e.what();
    } catch (const std::exception& e) {
      code = ErrorCode::kInternal;
      message = std::string("internal error: ") + e.what();
    }
  }
  // Refused reports are part of normal operation (a worker that lost its job); malformed
  // frames are not, but a flood of them must not flood the log either. A failure of the
  // coordinator's own I/O (its journal on a full disk) is the operator's to fix: logged.
  bool malformed = code == ErrorCode::kProtocol || code == ErrorCode::kCorrupt;
  if (malformed && (++bad_messages <= 20 || bad_messages % 1000 == 0))
    LS_LOG_WARN("bad message #{}: {}", bad_messages, message);
  else if (code == ErrorCode::kInternal || code == ErrorCode::kIo || code == ErrorCode::kResource)
    LS_LOG_ERROR("request failed: {}", message);
  else
    LS_LOG_DEBUG("request refused: {}", message);
  try {
    SendError(identity, rid, code, message);
  } catch (const std::exception& e) {
    LS_LOG_WARN("cannot send an error reply: {}", e.what());
  }
}

void CoordinatorServer::Impl::AnswerWatches(double now, bool all) {
  for (auto it = watches.begin(); it != watches.end();) {
    if (all || core->version() > it->request.since_version || now >= it->deadline) {
      try {
        Send(it->identity,
             EncodeMessage(core->Watch(it->request, now, it->viewer), it->request_id));
      } catch (const Error& e) {
        SendError(it->identity, it->request_id, e.code(), e.what());
      }
      it = watches.erase(it);
    } else {
      ++it;
    }
  }
}

void CoordinatorServer::Run(const std::atomic<bool>& stop) {
  Impl& s = *impl_;
  std::vector<zmq::pollitem_t> items = {{s.router.handle(), 0, ZMQ_POLLIN, 0}};
  if (s.curve) items.push_back({s.zap.handle(), 0, ZMQ_POLLIN, 0});
  while (!stop.load()) {
    try {
      zmq::poll(items.data(), items.size(), std::chrono::milliseconds(50));
    } catch (const zmq::error_t& e) {
      if (e.num() != EINTR) throw;
      continue;
    }
    if (s.curve && (items[1].revents & ZMQ_POLLIN)) s.HandleZap();
    // Drain a bounded batch, so ticks and watches keep running under a flood.
    for (int i = 0; i < 1000; ++i) {
      std::vector<zmq::message_t> frames;
      if (!zmq::recv_multipart(s.router, std::back_inserter(frames), zmq::recv_flags::dontwait))
        break;
      s.HandleFrames(frames);
      if (s.curve) s.HandleZap();
    }
    double now = SteadySeconds();
    try {
      s.core->Tick(now);
    } catch (const std::exception& e) {
      LS_LOG_ERROR("tick failed: {}", e.what());
    }
    s.AnswerWatches(now, false);
  }
  s.AnswerWatches(SteadySeconds(), true);
  LS_LOG_INFO("coordinator stopped");
}

}  // namespace lorastream::coordinator
