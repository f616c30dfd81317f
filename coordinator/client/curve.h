// CURVE keys for the coordinator protocol. `lorastream keygen --out DIR` writes one key pair
// for the coordinator, one for its clients (the command) and one for its workers:
//   DIR/coordinator.pub  DIR/coordinator.key  DIR/client.pub  DIR/client.key
//   DIR/worker.pub  DIR/worker.key
//   DIR/authorized_clients   (public keys the coordinator accepts from clients, one Z85 key a
//                             line, optionally followed by the local user name the key acts
//                             as: "KEY alice"; a key without a name acts as the operator)
//   DIR/authorized_workers   (public keys the coordinator accepts from workers, one a line)
// A worker's key is not a client's: only a key in authorized_workers registers as a worker
// and reports on jobs, and such a key does nothing else. Secret keys are written owner-only
// (0600). The coordinator loads coordinator.*, authorized_clients and authorized_workers;
// clients load coordinator.pub and client.*, workers coordinator.pub and worker.* (so client
// hosts get copies of coordinator.pub and client.*, worker hosts of coordinator.pub and
// worker.*, never coordinator.key). Keys are Z85 text (40 chars). To admit another key pair,
// append its public key to the matching list.
#pragma once

#include <map>
#include <set>
#include <string>

namespace lorastream::client {

struct CurveKeyPair {
  std::string public_key;  // Z85
  std::string secret_key;  // Z85
};

struct CurveServerKeys {
  CurveKeyPair server;
  std::set<std::string> authorized_clients;      // Z85 public keys
  std::set<std::string> authorized_workers;      // Z85 public keys of workers
  std::map<std::string, std::string> key_users;  // key -> local user name, when mapped
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
// The pieces of the above, for commands that lay keys out themselves (`lorastream slurm`): a
// fresh key pair; one Z85 key written into `path` through a temporary file, 0600 when
// `secret` (else 0644); one read back (kNotFound, kCorrupt naming the file).
CurveKeyPair NewCurveKeyPair();
void WriteCurveKeyFile(const std::string& path, const std::string& key, bool secret);
std::string ReadCurveKeyFile(const std::string& path);
// `role`: "client" (client.pub, client.key) or "worker" (worker.pub, worker.key).
CurveClientKeys LoadClientKeys(const std::string& dir, const std::string& role = "client");

// True for endpoints that only this host can reach: ipc://, inproc://, and tcp:// on
// 127.0.0.0/8, ::1 or localhost.
bool IsLocalEndpoint(const std::string& endpoint);
// True for ipc:// and inproc://: endpoints whose peers the kernel identifies (an ipc socket's
// folder permissions decide who connects; the coordinator learns each peer's uid). Every
// other endpoint, loopback TCP included, needs CURVE keys or --insecure (on loopback, any
// local user could otherwise act as the operator).
bool IsCredentialEndpoint(const std::string& endpoint);

// The owner-only folder of the default endpoint: $XDG_RUNTIME_DIR/lorastream when
// XDG_RUNTIME_DIR is set, else /tmp/lorastream-UID (UID: the effective uid).
std::string DefaultRuntimeDir();
// ipc://DefaultRuntimeDir()/coordinator.sock: what the coordinator binds and the client verbs
// and workers connect to when no endpoint is named (LORASTREAM_COORDINATOR overrides).
std::string DefaultEndpoint();
// What is wrong with `dir` as the folder of this user's coordinator socket: "" when it is a
// folder (not a symbolic link) owned by this user that no one else may write, or when it is
// missing; else the problem, naming the owner and the fix. The one check of the coordinator
// (EnsureOwnerOnlyDir), of every client and worker before they connect to the default
// endpoint (a folder another user made first would let that user answer in the
// coordinator's place), and of `doctor`.
std::string RuntimeDirProblem(const std::string& dir);
// RuntimeDirProblem for the folder of `endpoint` when that is DefaultRuntimeDir() (ipc://
// under it); "" for every other endpoint. `missing` is set when the folder does not exist.
std::string EndpointDirProblem(const std::string& endpoint, bool* missing = nullptr);
// Creates `dir` (0700) when missing, tightens this user's own folder to 0700, and refuses
// (Error kRefused, RuntimeDirProblem's text) a folder that is a link or another user's.
void EnsureOwnerOnlyDir(const std::string& dir);
// For an ipc:// endpoint whose socket this process may not reach (a folder it cannot search):
// why, naming the path and the way in; "" otherwise (and for every other transport).
std::string IpcPermissionProblem(const std::string& endpoint);

}  // namespace lorastream::client
