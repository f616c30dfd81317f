// Opening a job's files as the job's submitter (README: Trust model). A root worker runs other
// users' jobs; for the thread that trains one, the file-system uid and gid (setfsuid,
// setfsgid) and the supplementary groups become the submitter's while an ActingAs lives. The
// kernel then checks every open, create, rename and remove of that thread against the user
// at the moment it is made, so a link placed in a job's folders before or during the job
// leads only where the user could go; and what the thread creates belongs to the user from
// its creation: nothing is ever handed over with a chown of a path afterwards.
//
// Only the calling thread changes (Linux keeps these credentials per thread; the raw system
// calls are used, not the glibc wrappers that change every thread of the process). Threads
// it starts meanwhile inherit the identity: start none that open files while one is active.
// The process's real and effective uids never change, so the worker keeps its own rights
// (signals, shared memory it already mapped) and gets its file-system identity back at the
// end. Torch-free.
#pragma once

#include <sys/types.h>

#include <vector>

#include "common/posix/user_access.h"

namespace lorastream {

class ActingAs {
 public:
  // Switches the calling thread's file-system identity to `who`; nullptr, or `who` being
  // this process's own effective user, changes nothing. Error(kRefused) when the switch
  // needs privileges this process lacks (a worker that is not root serving another user),
  // Error(kInternal) when the kernel did not take it.
  explicit ActingAs(const UserIdentity* who);
  ~ActingAs();  // back to the thread's previous identity (aborts if the kernel refuses)
  ActingAs(const ActingAs&) = delete;
  ActingAs& operator=(const ActingAs&) = delete;

  bool active() const { return active_; }

 private:
  void Restore();

  bool active_ = false;
  uid_t saved_fsuid_ = 0;
  gid_t saved_fsgid_ = 0;
  std::vector<gid_t> saved_groups_;
};

}  // namespace lorastream
