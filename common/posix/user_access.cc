#include "common/posix/user_access.h"

#include <grp.h>
#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "common/base/error.h"

namespace lorastream {
namespace {

constexpr int kR = 4, kW = 2, kX = 1;  // in the owner/group/other triplets' order

std::vector<std::string> Split(const std::string& path) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (start <= path.size()) {
    size_t end = path.find('/', start);
    if (end == std::string::npos) end = path.size();
    if (end > start) parts.push_back(path.substr(start, end - start));
    start = end + 1;
  }
  return parts;
}

std::string Join(const std::vector<std::string>& parts, size_t count) {
  std::string out;
  for (size_t i = 0; i < count; ++i) out += "/" + parts[i];
  return out.empty() ? "/" : out;
}

std::string Absolute(const std::string& path) {
  if (!path.empty() && path[0] == '/') return path;
  char cwd[PATH_MAX];
  if (!::getcwd(cwd, sizeof(cwd))) ThrowErrno("getcwd");
  return std::string(cwd) + "/" + path;
}

UserIdentity FromPasswd(const passwd& pw) {
  UserIdentity who;
  who.uid = pw.pw_uid;
  who.gid = pw.pw_gid;
  who.name = pw.pw_name;
  int n = 32;
  std::vector<gid_t> groups(static_cast<size_t>(n));
  while (::getgrouplist(pw.pw_name, pw.pw_gid, groups.data(), &n) < 0)
    groups.resize(static_cast<size_t>(n) + 32), n = static_cast<int>(groups.size());
  groups.resize(static_cast<size_t>(n));
  who.groups = std::move(groups);
  return who;
}

bool InGroup(const UserIdentity& who, gid_t gid) {
  return gid == who.gid || std::find(who.groups.begin(), who.groups.end(), gid) != who.groups.end();
}

// Whether the mode bits of `st` grant `who` every bit of `mask` (kR | kW | kX).
bool Allows(const struct stat& st, const UserIdentity& who, int mask) {
  if (who.uid == 0)  // root: everything, except executing a file nobody may execute
    return !(mask & kX) || S_ISDIR(st.st_mode) || (st.st_mode & 0111);
  int bits = st.st_uid == who.uid      ? (st.st_mode >> 6) & 7
             : InGroup(who, st.st_gid) ? (st.st_mode >> 3) & 7
                                       : st.st_mode & 7;
  return (bits & mask) == mask;
}

std::string Why(const std::string& what, const std::string& path, const struct stat& st) {
  char mode[16];
  std::snprintf(mode, sizeof(mode), "%04o", static_cast<unsigned>(st.st_mode & 07777));
  return "no permission to " + what + " " + path + " (mode " + mode + ", owner " +
         DescribeUser(st.st_uid) + ")";
}

// Every folder above the last component of `path` must be searchable (the ones that exist).
std::string CheckAncestors(const std::string& path, const UserIdentity& who) {
  std::vector<std::string> parts = Split(path);
  for (size_t k = 0; k < parts.size(); ++k) {
    std::string dir = Join(parts, k);
    struct stat st {};
    if (::stat(dir.c_str(), &st) != 0) return "";  // missing from here on: created later
    if (!S_ISDIR(st.st_mode)) return dir + " is not a folder";
    if (!Allows(st, who, kX)) return Why("search", dir, st);
  }
  return "";
}

}  // namespace

UserIdentity LookupUser(uid_t uid) {
  std::vector<char> buf(16384);
  passwd pw{};
  passwd* found = nullptr;
  if (::getpwuid_r(uid, &pw, buf.data(), buf.size(), &found) != 0 || !found)
    throw Error(ErrorCode::kNotFound,
                "uid " + std::to_string(uid) + " has no account on this host");
  return FromPasswd(pw);
}

UserIdentity LookupUser(const std::string& name) {
  std::vector<char> buf(16384);
  passwd pw{};
  passwd* found = nullptr;
  if (::getpwnam_r(name.c_str(), &pw, buf.data(), buf.size(), &found) != 0 || !found)
    throw Error(ErrorCode::kNotFound, "no user named `" + name + "` on this host");
  return FromPasswd(pw);
}

std::string DescribeUser(uid_t uid) {
  std::vector<char> buf(16384);
  passwd pw{};
  passwd* found = nullptr;
  if (::getpwuid_r(uid, &pw, buf.data(), buf.size(), &found) == 0 && found)
    return std::string(pw.pw_name) + " (uid " + std::to_string(uid) + ")";
  return "uid " + std::to_string(uid);
}

std::string CanonicalPath(const std::string& path) {
  std::vector<std::string> parts = Split(Absolute(path));
  // The longest prefix that resolves; "/" always does.
  size_t k = parts.size();
  std::string base;
  for (;; --k) {
    char resolved[PATH_MAX];
    if (::realpath(Join(parts, k).c_str(), resolved)) {
      base = resolved;
      break;
    }
    if (k == 0) return Join(parts, parts.size());  // not even "/": leave it lexical
  }
  std::vector<std::string> out = Split(base);
  for (size_t i = k; i < parts.size(); ++i) {
    if (parts[i] == ".") continue;
    if (parts[i] == "..") {
      if (!out.empty()) out.pop_back();
      continue;
    }
    out.push_back(parts[i]);
  }
  return Join(out, out.size());
}

std::string AccessProblem(const std::string& path, const UserIdentity& who, PathAccess access) {
  const std::string absolute = Absolute(path);
  const std::string canonical = CanonicalPath(absolute);
  // Along the path as written (the links it passes through) and along where it leads.
  for (const std::string& p : {absolute, canonical})
    if (std::string why = CheckAncestors(p, who); !why.empty()) return why;
  struct stat st {};
  if (::stat(canonical.c_str(), &st) == 0) {
    int mask = access == PathAccess::kRead ? kR : kW;
    if (S_ISDIR(st.st_mode)) mask |= kX;
    if (!Allows(st, who, mask))
      return Why(access == PathAccess::kRead ? "read" : "write", canonical, st);
    return "";
  }
  if (access == PathAccess::kRead) return "";  // missing: the reader reports that itself
  // Created: in the longest existing ancestor, with any missing folders between.
  std::vector<std::string> parts = Split(canonical);
  for (size_t k = parts.size(); k-- > 0;) {
    std::string dir = Join(parts, k);
    if (::stat(dir.c_str(), &st) != 0) continue;
    if (!S_ISDIR(st.st_mode)) return dir + " is not a folder";
    if (!Allows(st, who, kW | kX)) return Why("create files in", dir, st);
    return "";
  }
  return "";
}

}  // namespace lorastream
