// A throw-away local user for the multi-user tests (docs/TRUST.md): created with
// useradd when the test starts, removed with `userdel -r` when it ends, even on failure.
// Needs root (CI runs as root); elsewhere available() is false and the test says so with a
// WARN and returns.
#pragma once

#include <sys/stat.h>
#include <unistd.h>

#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "common/posix/subprocess.h"
#include "common/posix/user_access.h"

namespace lorastream::testing {

class TempUser {
 public:
  explicit TempUser(const std::string& tag) {
    if (::geteuid() != 0) return;
    name_ = "ls" + tag + std::to_string(::getpid() % 100000);
    Quiet({"userdel", "-r", name_});  // a leftover of a killed run
    int code = -1;
    RunAndCapture({"useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name_}, &code, 60,
                  "/dev/null");
    REQUIRE(code == 0);
    created_ = true;
    identity_ = LookupUser(name_);
  }
  ~TempUser() {
    if (created_) Quiet({"userdel", "-r", name_});
  }
  TempUser(const TempUser&) = delete;
  TempUser& operator=(const TempUser&) = delete;

  bool available() const { return created_; }
  const std::string& name() const { return name_; }
  const UserIdentity& identity() const { return identity_; }
  uid_t uid() const { return identity_.uid; }
  gid_t gid() const { return identity_.gid; }

  // argv run as this user (its uid, gid and groups).
  std::vector<std::string> As(const std::vector<std::string>& argv) const {
    std::vector<std::string> out = {"setpriv", "--reuid=" + std::to_string(uid()),
                                    "--regid=" + std::to_string(gid()), "--init-groups", "--"};
    out.insert(out.end(), argv.begin(), argv.end());
    return out;
  }
  // Gives `path` (not following links) to this user.
  void Own(const std::string& path) const { REQUIRE(::lchown(path.c_str(), uid(), gid()) == 0); }

 private:
  static void Quiet(const std::vector<std::string>& argv) {
    int code = 0;
    RunAndCapture(argv, &code, 60, "/dev/null");
  }
  std::string name_;
  bool created_ = false;
  UserIdentity identity_;
};

// In a test body: `TempUser user("x"); SKIP_UNLESS_ROOT(user);`
#define SKIP_UNLESS_ROOT(user)                                                     \
  if (!(user).available()) {                                                       \
    WARN("skipped: this multi-user test creates a temporary user and needs root"); \
    return;                                                                        \
  }

}  // namespace lorastream::testing
