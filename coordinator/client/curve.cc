#include "coordinator/client/curve.h"

#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "common/base/error.h"
#include "common/posix/user_access.h"

namespace lorastream::client {
namespace fs = std::filesystem;
namespace {

constexpr size_t kZ85KeyChars = 40;

void WriteKeyFile(const fs::path& path, const std::string& text, bool secret) {
  fs::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    if (!out) ThrowErrno("cannot write " + tmp.string());
    out << text << "\n";
    if (!out.flush()) ThrowErrno("cannot write " + tmp.string());
  }
  if (::chmod(tmp.c_str(), secret ? 0600 : 0644) != 0) ThrowErrno("chmod " + tmp.string());
  fs::rename(tmp, path);
}

bool ValidZ85Key(const std::string& key) {
  if (key.size() != kZ85KeyChars) return false;
  uint8_t raw[32];
  return zmq_z85_decode(raw, key.c_str()) != nullptr;
}

std::string ReadKey(const fs::path& path) {
  std::ifstream in(path);
  if (!in)
    throw Error(ErrorCode::kNotFound, "CURVE key file " + path.string() +
                                          " is missing (create keys with `lorastream keygen`)");
  std::string key;
  in >> key;
  if (!ValidZ85Key(key))
    throw Error(ErrorCode::kCorrupt,
                "CURVE key file " + path.string() + " does not hold a 40-character Z85 key");
  return key;
}

CurveKeyPair NewKeyPair() {
  char pub[41], sec[41];
  if (zmq_curve_keypair(pub, sec) != 0)
    throw Error(ErrorCode::kUnsupported,
                "zmq_curve_keypair failed: " + std::string(zmq_strerror(zmq_errno())));
  return CurveKeyPair{pub, sec};
}

}  // namespace

void RequireCurveSupport() {
  if (!zmq_has("curve"))
    throw Error(ErrorCode::kUnsupported, "this libzmq was built without CURVE support");
}

void WriteCurveKeys(const std::string& dir, bool force) {
  RequireCurveSupport();
  fs::path d(dir);
  std::error_code ec;
  fs::create_directories(d, ec);
  if (ec) throw Error(ErrorCode::kIo, "cannot create " + dir + ": " + ec.message());
  for (const char* name : {"coordinator.key", "client.key", "worker.key"})
    if (!force && fs::exists(d / name))
      throw Error(ErrorCode::kInvalidArgument,
                  (d / name).string() + " exists; pass --force to replace the keys");
  CurveKeyPair server = NewKeyPair();
  CurveKeyPair client = NewKeyPair();
  CurveKeyPair worker = NewKeyPair();
  WriteKeyFile(d / "coordinator.pub", server.public_key, false);
  WriteKeyFile(d / "coordinator.key", server.secret_key, true);
  WriteKeyFile(d / "client.pub", client.public_key, false);
  WriteKeyFile(d / "client.key", client.secret_key, true);
  WriteKeyFile(d / "worker.pub", worker.public_key, false);
  WriteKeyFile(d / "worker.key", worker.secret_key, true);
  WriteKeyFile(d / "authorized_clients", client.public_key, false);
  WriteKeyFile(d / "authorized_workers", worker.public_key, false);
}

CurveServerKeys LoadServerKeys(const std::string& dir) {
  RequireCurveSupport();
  fs::path d(dir);
  CurveServerKeys keys;
  keys.server.public_key = ReadKey(d / "coordinator.pub");
  keys.server.secret_key = ReadKey(d / "coordinator.key");
  std::ifstream in(d / "authorized_clients");
  if (!in) throw Error(ErrorCode::kNotFound, (d / "authorized_clients").string() + " is missing");
  std::string line;
  int number = 0;
  while (std::getline(in, line)) {
    ++number;
    std::istringstream words(line);
    std::string key;
    if (!(words >> key) || key[0] == '#') continue;
    const std::string where = (d / "authorized_clients").string() + ":" + std::to_string(number);
    if (!ValidZ85Key(key))
      throw Error(ErrorCode::kCorrupt, where + ": not a 40-character Z85 public key");
    keys.authorized_clients.insert(key);
    std::string user;
    if (words >> user && user[0] != '#') {
      try {
        LookupUser(user);
      } catch (const Error& e) {
        throw Error(ErrorCode::kInvalidArgument, where + ": " + e.what());
      }
      keys.key_users[key] = user;
    }
  }
  if (keys.authorized_clients.empty())
    throw Error(ErrorCode::kInvalidArgument,
                (d / "authorized_clients").string() + " lists no client key");
  const fs::path workers = d / "authorized_workers";
  std::ifstream worker_list(workers);
  if (!worker_list)
    throw Error(ErrorCode::kNotFound,
                workers.string() +
                    " is missing: the coordinator admits as workers only the keys it lists "
                    "(keys from an older `lorastream keygen`: write a worker key pair with "
                    "`lorastream keygen --out DIR --force` and give worker.* to the workers)");
  for (number = 1; std::getline(worker_list, line); ++number) {
    std::istringstream words(line);
    std::string key;
    if (!(words >> key) || key[0] == '#') continue;
    if (!ValidZ85Key(key))
      throw Error(ErrorCode::kCorrupt, workers.string() + ":" + std::to_string(number) +
                                           ": not a 40-character Z85 public key");
    if (keys.authorized_clients.count(key))
      throw Error(ErrorCode::kInvalidArgument,
                  workers.string() + ":" + std::to_string(number) +
                      ": this key is also a client's (authorized_clients); a worker's key must "
                      "be its own");
    keys.authorized_workers.insert(key);
  }
  return keys;
}

CurveClientKeys LoadClientKeys(const std::string& dir, const std::string& role) {
  RequireCurveSupport();
  fs::path d(dir);
  CurveClientKeys keys;
  keys.server_public_key = ReadKey(d / "coordinator.pub");
  keys.client.public_key = ReadKey(d / (role + ".pub"));
  keys.client.secret_key = ReadKey(d / (role + ".key"));
  return keys;
}

CurveKeyPair NewCurveKeyPair() {
  RequireCurveSupport();
  return NewKeyPair();
}

void WriteCurveKeyFile(const std::string& path, const std::string& key, bool secret) {
  WriteKeyFile(path, key, secret);
}

std::string ReadCurveKeyFile(const std::string& path) { return ReadKey(path); }

bool IsLocalEndpoint(const std::string& endpoint) {
  if (endpoint.rfind("ipc://", 0) == 0 || endpoint.rfind("inproc://", 0) == 0) return true;
  if (endpoint.rfind("tcp://", 0) != 0) return false;
  std::string rest = endpoint.substr(6);
  std::string host;
  if (!rest.empty() && rest[0] == '[') {
    size_t close = rest.find(']');
    if (close == std::string::npos) return false;
    host = rest.substr(1, close - 1);
    return host == "::1";
  }
  size_t colon = rest.rfind(':');
  host = rest.substr(0, colon);
  if (host == "localhost") return true;
  // 127.0.0.0/8, written as four decimal numbers.
  unsigned a, b, c, d;
  char tail;
  return std::sscanf(host.c_str(), "%u.%u.%u.%u%c", &a, &b, &c, &d, &tail) == 4 && a == 127 &&
         b < 256 && c < 256 && d < 256;
}

bool IsCredentialEndpoint(const std::string& endpoint) {
  return endpoint.rfind("ipc://", 0) == 0 || endpoint.rfind("inproc://", 0) == 0;
}

std::string DefaultRuntimeDir() {
  const char* xdg = std::getenv("XDG_RUNTIME_DIR");
  if (xdg && xdg[0] == '/') return std::string(xdg) + "/lorastream";
  return "/tmp/lorastream-" + std::to_string(::geteuid());
}

std::string DefaultEndpoint() { return "ipc://" + DefaultRuntimeDir() + "/coordinator.sock"; }

std::string RuntimeDirProblem(const std::string& dir) {
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0) return "";
  const std::string fix = "; remove it (as its owner or root) and start the coordinator again";
  if (!S_ISDIR(st.st_mode)) return dir + " is not a folder (a link or a file)" + fix;
  if (st.st_uid != ::geteuid())
    return dir + " belongs to " + DescribeUser(st.st_uid) + ", not to " +
           DescribeUser(::geteuid()) + ": whoever listens there is not this user's coordinator" +
           fix;
  if (st.st_mode & 022) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    return dir + " (mode " + mode + ") may be written by other users" + "; `chmod 700 " + dir +
           "` (the coordinator does it when it starts)";
  }
  return "";
}

std::string EndpointDirProblem(const std::string& endpoint, bool* missing) {
  if (missing) *missing = false;
  if (endpoint.rfind("ipc://", 0) != 0) return "";
  const std::string dir = DefaultRuntimeDir();
  if (endpoint.rfind("ipc://" + dir + "/", 0) != 0) return "";
  struct stat st {};
  if (missing && ::lstat(dir.c_str(), &st) != 0) *missing = true;
  return RuntimeDirProblem(dir);
}

void EnsureOwnerOnlyDir(const std::string& dir) {
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) ThrowErrno("cannot create " + dir);
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0) ThrowErrno("cannot inspect " + dir);
  // This user's own folder, opened up: closed again before the check.
  if (S_ISDIR(st.st_mode) && st.st_uid == ::geteuid() && (st.st_mode & 077) &&
      ::chmod(dir.c_str(), 0700) != 0)
    ThrowErrno("cannot make " + dir + " owner-only");
  if (std::string why = RuntimeDirProblem(dir); !why.empty()) throw Error(ErrorCode::kRefused, why);
}

std::string IpcPermissionProblem(const std::string& endpoint) {
  if (endpoint.rfind("ipc://", 0) != 0) return "";
  const std::string path = endpoint.substr(6);
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 || errno != EACCES) return "";
  return "cannot reach the coordinator at " + endpoint +
         ": permission denied on its folder "
         "(only the user it belongs to may connect there; other users need a CURVE key "
         "authorized for them and the coordinator's tcp:// endpoint)";
}

}  // namespace lorastream::client
