#include "common/job/job_access.h"

#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <vector>

#include "common/base/error.h"
#include "common/base/log.h"
#include "common/job/flux_job.h"

namespace lorastream {
namespace {

// The entries of folder `dir` (sorted, without "." and ".."); empty when it cannot be listed
// (AccessProblem on the folder itself says why).
std::vector<std::string> Entries(const std::string& dir) {
  std::vector<std::string> out;
  DIR* d = ::opendir(dir.c_str());
  if (!d) return out;
  while (dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name != "." && name != "..") out.push_back(dir + "/" + name);
  }
  ::closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

struct Attempt {
  int64_t job = 0;
  int32_t attempt = 0;
};

std::optional<Attempt> ParseAttempt(const std::string& holder) {
  long long job = 0;
  int attempt = 0;
  if (std::sscanf(holder.c_str(), "job %lld attempt %d", &job, &attempt) != 2) return std::nullopt;
  return Attempt{job, attempt};
}

}  // namespace

std::string AttemptHolder(int64_t job_id, int32_t attempt, const std::string& who) {
  return "job " + std::to_string(job_id) + " attempt " + std::to_string(attempt) + " (" + who + ")";
}

OutputDirLock OutputDirLock::Acquire(const std::string& output_dir, const std::string& holder) {
  const std::string path = output_dir + "/" + kOutputDirLockName;
  FileLock lock = FileLock::Open(path);
  if (!lock.held()) {
    const std::string theirs = lock.Holder();
    const std::optional<Attempt> old = ParseAttempt(theirs), mine = ParseAttempt(holder);
    if (!old || !mine || old->job != mine->job || old->attempt >= mine->attempt)
      throw Error(ErrorCode::kRefused, "train.output_dir " + output_dir + " is in use by " +
                                           theirs + " (lock file " + path + ")");
    LS_LOG_WARN(
        "train.output_dir {}: taking it over from {}, which the coordinator declared "
        "dead; it stops at its next step if it still runs",
        output_dir, theirs);
  }
  lock.SetHolder(holder);
  return OutputDirLock(std::move(lock), holder, output_dir);
}

OutputDirLock OutputDirLock::CreateAndAcquire(const std::string& output_dir,
                                              const std::string& holder) {
  std::error_code dir_error;
  std::filesystem::create_directories(output_dir, dir_error);
  if (dir_error)
    throw Error(ErrorCode::kIo,
                "the output folder " + output_dir + " cannot be created: " + dir_error.message());
  return Acquire(output_dir,
                 holder.empty() ? "lorastream-worker pid " + std::to_string(::getpid()) : holder);
}

bool OutputDirLock::StillOwned() {
  if (lock_.Holder() != holder_) return false;
  lock_.TryLock();  // the older attempt has let go: hold the lock from now on
  return true;
}

void OutputDirLock::RequireOwned() {
  if (!StillOwned())
    throw Error(ErrorCode::kRefused, "train.output_dir " + dir_ + " was taken over by " +
                                         lock_.Holder() +
                                         ": this attempt stops without writing anything more");
}

void CheckJobPathsAs(const JobSpec& spec, const UserIdentity& who) {
  struct Item {
    std::string key;
    std::string path;
    PathAccess access;
  };
  std::vector<Item> items;
  // A FLUX.1 job's keys as its file writes them ([flux] alone, or the shared sections).
  const std::string checkpoint_key =
      spec.is_flux ? FluxKeyName(spec.flux, "checkpoint") : "model.checkpoint";
  if (spec.is_flux) {
    const std::string cache_key = FluxKeyName(spec.flux, "cache_dir");
    items = {{cache_key, spec.flux.cache_dir, PathAccess::kRead},
             {checkpoint_key, spec.flux.checkpoint, PathAccess::kRead},
             {FluxKeyName(spec.flux, "output_dir"), spec.flux.output_dir, PathAccess::kWrite}};
    for (const std::string& file : Entries(spec.flux.cache_dir))
      items.push_back({cache_key, file, PathAccess::kRead});
  } else {
    items = {{"data.path", spec.data.path, PathAccess::kRead},
             {"eval.path", spec.eval.path, PathAccess::kRead},
             {"model.checkpoint", spec.model.checkpoint, PathAccess::kRead},
             {"train.output_dir", spec.train.output_dir, PathAccess::kWrite},
             {"train.stats_file", spec.train.stats_file, PathAccess::kWrite}};
    if (spec.is_qwen_image) {
      items.push_back({"qwen_image.cache_dir", spec.qwen_image.cache_dir, PathAccess::kRead});
      for (const std::string& file : Entries(spec.qwen_image.cache_dir))
        items.push_back({"qwen_image.cache_dir", file, PathAccess::kRead});
    }
  }
  // Every file of a model folder, and where its links lead (a weights file may be a link).
  if (!spec.model.checkpoint.empty())
    for (const std::string& file : Entries(spec.model.checkpoint))
      items.push_back({checkpoint_key, file, PathAccess::kRead});
  for (const Item& item : items) {
    if (item.path.empty()) continue;
    std::string why = AccessProblem(item.path, who, item.access);
    if (!why.empty())
      throw Error(ErrorCode::kRefused,
                  spec.source + ": key `" + item.key + "` (" + item.path +
                      "): the job's submitter " + who.name + " (uid " + std::to_string(who.uid) +
                      ") may not " + (item.access == PathAccess::kRead ? "read" : "write") +
                      " it: " + why + "; the worker opens only what the submitter could");
  }
}

}  // namespace lorastream
