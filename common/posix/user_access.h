// Who a job belongs to, and what that user may open: the check a worker running as another
// user (root, typically) makes before it touches a path named in a job, so that nobody gets
// the worker to read or write for them what they could not themselves (README: Trust model).
//
// The check walks every component of the path with the user's uid, primary gid and
// supplementary groups against the classic mode bits (search on each directory, read or
// write on the target, write on the folder a missing file would be created in), both along
// the path as written and along its canonical form (symbolic links resolved). POSIX ACLs and
// capabilities are not consulted: a path an ACL opens to the user is refused (fail closed).
// Torch-free, plain POSIX.
#pragma once

#include <sys/types.h>

#include <optional>
#include <string>
#include <vector>

namespace lorastream {

struct UserIdentity {
  uid_t uid = 0;
  gid_t gid = 0;
  std::vector<gid_t> groups;  // supplementary groups, the primary one included
  std::string name;
};

// The account of `uid` from the user database (getpwuid + getgrouplist). Error(kNotFound)
// naming the uid when it has no account on this host.
UserIdentity LookupUser(uid_t uid);
// By login name; Error(kNotFound) naming it when unknown.
UserIdentity LookupUser(const std::string& name);
// "alice (uid 1001)", or "uid 1001" when the uid has no account.
std::string DescribeUser(uid_t uid);

enum class PathAccess {
  kRead,   // open an existing file for reading
  kWrite,  // write or create: an existing target must be writable; a missing one is created
           // (with its missing parent folders) in the longest existing ancestor, which must
           // be a folder the user may write and search
};

// Empty when `who` may do `access` on `path`; otherwise why not, naming the path component
// at fault ("no permission to search /root (mode 0700, owner root)"). Relative paths are
// taken from the current directory.
std::string AccessProblem(const std::string& path, const UserIdentity& who, PathAccess access);

// The path with every symbolic link, ".", ".." and repeated or trailing "/" resolved, so that
// two spellings of one folder compare equal ("/x/dd", "/x/dd/", "/x/./dd", a link to it).
// The longest existing prefix is resolved through the file system, the rest lexically.
std::string CanonicalPath(const std::string& path);

}  // namespace lorastream
