// The coordinator daemon: a ZeroMQ ROUTER socket in front of Coordinator. One thread runs the
// loop (receive, dispatch, reply, tick), so the state needs no locks. Every request gets one
// reply; a frame that does not decode (garbage, truncated, oversized, another protocol
// version, an unknown type) is logged and answered with ErrorReply, never a crash. Watch
// requests are long polls parked until the state changes or their wait ends.
#pragma once

#include <atomic>
#include <memory>
#include <string>

#include "coordinator/coordinator.h"

namespace lorastream {

// Loopback by default; the port spells "LS" on a phone keypad, roughly.
constexpr const char* kDefaultEndpoint = "tcp://127.0.0.1:5757";

struct ServerOptions {
  std::string bind = kDefaultEndpoint;
  std::string db = "lorastream.db";  // the SQLite journal
  std::string curve_keys_dir;        // "": no CURVE (only allowed on local endpoints)
  bool insecure = false;             // allow a non-local bind without CURVE
  CoordinatorOptions coordinator;
};

class CoordinatorServer {
 public:
  // Opens the journal and binds; throws Error (kInvalidArgument for a non-local bind without
  // keys or --insecure, kIo when the endpoint cannot be bound).
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

}  // namespace lorastream
