// The coordinator daemon: a ZeroMQ ROUTER socket in front of Coordinator. One thread runs the
// loop (receive, dispatch, reply, tick), so the state needs no locks. Every request gets one
// reply; a frame that does not decode (garbage, truncated, oversized, another protocol
// version, an unknown type) is logged and answered with ErrorReply, never a crash. Watch
// requests are long polls parked until the state changes or their wait ends.
#pragma once

#include <atomic>
#include <memory>
#include <string>

#include "coordinator/client/curve.h"
#include "coordinator/daemon/coordinator.h"

namespace lorastream::coordinator {

// Trust model (README): by default the coordinator listens on an ipc socket in an owner-only
// folder (DefaultEndpoint), so only its own user reaches it; on an ipc socket each request's
// user is the peer's uid, told by the kernel. Other local users and remote clients come in
// over tcp:// with a CURVE key; authorized_clients maps a key to the local user it acts as
// (an unmapped key acts as the operator). TCP without CURVE, even on loopback, needs
// --insecure: every client then acts as the operator.
struct ServerOptions {
  std::string bind = client::DefaultEndpoint();
  std::string db = "lorastream.db";  // the SQLite journal
  std::string curve_keys_dir;        // "": no CURVE (only allowed on ipc:// and inproc://)
  bool insecure = false;             // allow a tcp:// bind without CURVE
  CoordinatorOptions coordinator;
};

class CoordinatorServer {
 public:
  // Opens the journal and binds; throws Error (kInvalidArgument for a tcp bind without keys
  // or --insecure, kRefused when another coordinator holds the journal or listens on the
  // ipc socket, kIo when the endpoint cannot be bound).
  explicit CoordinatorServer(ServerOptions options);
  ~CoordinatorServer();
  CoordinatorServer(const CoordinatorServer&) = delete;
  CoordinatorServer& operator=(const CoordinatorServer&) = delete;

  // Serves until `stop` becomes true (checked at least every 100 ms).
  void Run(const std::atomic<bool>& stop);

  const std::string& endpoint() const;  // as bound (a tcp port 0 resolved)

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace lorastream::coordinator
