#include "common/posix/acting_as.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>

#include "common/base/error.h"

namespace lorastream {
namespace {

// setfsuid/setfsgid return the previous id and cannot report failure: asking again with an
// invalid id (-1) changes nothing and returns the current one.
uid_t CurrentFsUid() { return static_cast<uid_t>(::syscall(SYS_setfsuid, -1)); }
gid_t CurrentFsGid() { return static_cast<gid_t>(::syscall(SYS_setfsgid, -1)); }

std::vector<gid_t> ThreadGroups() {
  int n = ::getgroups(0, nullptr);
  std::vector<gid_t> groups(static_cast<size_t>(n > 0 ? n : 0));
  if (n > 0 && ::getgroups(n, groups.data()) != n) ThrowErrno("getgroups");
  return groups;
}

// This thread only (the raw call; glibc's setgroups changes every thread).
bool SetThreadGroups(const std::vector<gid_t>& groups) {
  return ::syscall(SYS_setgroups, groups.size(), groups.data()) == 0;
}

}  // namespace

ActingAs::ActingAs(const UserIdentity* who) {
  if (who == nullptr || who->uid == ::geteuid()) return;
  if (::geteuid() != 0)
    throw Error(ErrorCode::kRefused, "cannot open files as " + DescribeUser(who->uid) +
                                         ": this process runs as " + DescribeUser(::geteuid()) +
                                         ", not as root");
  saved_fsuid_ = CurrentFsUid();
  saved_fsgid_ = CurrentFsGid();
  saved_groups_ = ThreadGroups();
  // Groups and gid first: once the fsuid is not 0 the thread has no file capabilities left,
  // but it keeps CAP_SETGID and CAP_SETUID, which these calls need.
  if (!SetThreadGroups(who->groups)) ThrowErrno("setgroups for " + DescribeUser(who->uid));
  ::syscall(SYS_setfsgid, who->gid);
  ::syscall(SYS_setfsuid, who->uid);
  if (CurrentFsUid() != who->uid || CurrentFsGid() != who->gid) {
    Restore();  // no destructor runs for a constructor that throws
    throw Error(ErrorCode::kInternal,
                "the kernel did not switch this thread's file-system identity to " +
                    DescribeUser(who->uid));
  }
  active_ = true;
}

ActingAs::~ActingAs() {
  if (active_) Restore();
}

void ActingAs::Restore() {
  ::syscall(SYS_setfsuid, saved_fsuid_);
  ::syscall(SYS_setfsgid, saved_fsgid_);
  if (!SetThreadGroups(saved_groups_) || CurrentFsUid() != saved_fsuid_ ||
      CurrentFsGid() != saved_fsgid_) {
    // Going on as the wrong user is worse than stopping.
    std::fprintf(stderr, "lorastream: cannot restore this thread's file-system identity\n");
    std::abort();
  }
}

}  // namespace lorastream
