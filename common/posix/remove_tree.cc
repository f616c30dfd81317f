#include "common/posix/remove_tree.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace lorastream {

namespace {

void Note(std::string* error, const std::string& path, const char* what) {
  if (error != nullptr && error->empty())
    *error = path + ": " + what + " failed: " + std::strerror(errno);
}

// Removes every entry of the open directory `dir_fd` (consumed), depth first.
bool EmptyDirectory(int dir_fd, const std::string& path, std::string* error) {
  DIR* dir = fdopendir(dir_fd);
  if (dir == nullptr) {
    Note(error, path, "opendir");
    close(dir_fd);
    return false;
  }
  bool ok = true;
  while (struct dirent* e = readdir(dir)) {
    const char* name = e->d_name;
    if (std::strcmp(name, ".") == 0 || std::strcmp(name, "..") == 0) continue;
    const std::string child = path + "/" + name;
    struct stat st;
    if (fstatat(dirfd(dir), name, &st, AT_SYMLINK_NOFOLLOW) != 0) {
      if (errno == ENOENT) continue;  // removed meanwhile
      Note(error, child, "stat");
      ok = false;
      continue;
    }
    if (S_ISDIR(st.st_mode)) {
      const int fd = openat(dirfd(dir), name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
      if (fd < 0) {
        Note(error, child, "open");
        ok = false;
        continue;
      }
      ok = EmptyDirectory(fd, child, error) && ok;
      if (unlinkat(dirfd(dir), name, AT_REMOVEDIR) != 0 && errno != ENOENT) {
        Note(error, child, "rmdir");
        ok = false;
      }
    } else if (unlinkat(dirfd(dir), name, 0) != 0 && errno != ENOENT) {
      Note(error, child, "unlink");
      ok = false;
    }
  }
  closedir(dir);
  return ok;
}

}  // namespace

bool RemoveTree(const std::string& path, std::string* error) {
  struct stat st;
  if (lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return true;
    Note(error, path, "stat");
    return false;
  }
  if (!S_ISDIR(st.st_mode)) {
    if (unlink(path.c_str()) == 0 || errno == ENOENT) return true;
    Note(error, path, "unlink");
    return false;
  }
  const int fd = open(path.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) {
    Note(error, path, "open");
    return false;
  }
  bool ok = EmptyDirectory(fd, path, error);
  if (rmdir(path.c_str()) != 0 && errno != ENOENT) {
    Note(error, path, "rmdir");
    ok = false;
  }
  return ok;
}

}  // namespace lorastream
