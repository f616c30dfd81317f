#include "common/job_access.h"

#include <sys/stat.h>

#include "common/error.h"

namespace lorastream {

void CheckJobPathsAs(const JobSpec& spec, const UserIdentity& who) {
  struct Item {
    const char* key;
    const std::string& path;
    PathAccess access;
  };
  const Item items[] = {{"data.path", spec.data.path, PathAccess::kRead},
                        {"model.checkpoint", spec.model.checkpoint, PathAccess::kRead},
                        {"train.output_dir", spec.train.output_dir, PathAccess::kWrite},
                        {"train.stats_file", spec.train.stats_file, PathAccess::kWrite}};
  for (const Item& item : items) {
    if (item.path.empty()) continue;
    std::string why = AccessProblem(item.path, who, item.access);
    if (!why.empty())
      throw Error(ErrorCode::kRefused,
                  spec.source + ": key `" + item.key + "` (" + item.path +
                      "): the job's "
                      "submitter " +
                      who.name + " (uid " + std::to_string(who.uid) + ") may not " +
                      (item.access == PathAccess::kRead ? "read" : "write") + " it: " + why +
                      "; the worker opens only what the submitter could");
  }
}

std::string FirstMissingAncestor(const std::string& dir) {
  std::string top = dir;
  struct stat st {};
  for (std::string p = dir; !p.empty() && p != "/" && ::stat(p.c_str(), &st) != 0;) {
    top = p;
    size_t slash = p.find_last_of('/');
    if (slash == std::string::npos) break;
    p = p.substr(0, slash == 0 ? 1 : slash);
  }
  return top;
}

}  // namespace lorastream
