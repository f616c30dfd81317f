// CURVE keys for the coordinator protocol. `lorastream keygen --out DIR` writes one key pair
// for the coordinator and one for its clients (workers and the command):
//   DIR/coordinator.pub  DIR/coordinator.key  DIR/client.pub  DIR/client.key
//   DIR/authorized_clients   (public keys the coordinator accepts, one Z85 key a line)
// Secret keys are written owner-only (0600). The coordinator loads coordinator.* and
// authorized_clients; clients load coordinator.pub and client.* (so client hosts get copies of
// those three files, never coordinator.key). Keys are Z85 text (40 chars). To admit another
// client key pair, append its public key to authorized_clients.
#pragma once

#include <set>
#include <string>

namespace lorastream {

struct CurveKeyPair {
  std::string public_key;  // Z85
  std::string secret_key;  // Z85
};

struct CurveServerKeys {
  CurveKeyPair server;
  std::set<std::string> authorized_clients;  // Z85 public keys
};

struct CurveClientKeys {
  std::string server_public_key;
  CurveKeyPair client;
};

// Throws Error(kUnsupported) when libzmq was built without CURVE.
void RequireCurveSupport();
// Writes a fresh set of keys into `dir` (created when missing). Refuses to overwrite
// existing keys unless `force` (kInvalidArgument).
void WriteCurveKeys(const std::string& dir, bool force);
CurveServerKeys LoadServerKeys(const std::string& dir);
CurveClientKeys LoadClientKeys(const std::string& dir);

// True for endpoints that only this host can reach: ipc://, inproc://, and tcp:// on
// 127.0.0.0/8, ::1 or localhost. Anything else needs CURVE keys or --insecure.
bool IsLocalEndpoint(const std::string& endpoint);

}  // namespace lorastream
