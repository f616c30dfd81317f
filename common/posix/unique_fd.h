// An owned POSIX file descriptor: closed when its owner dies, so no error path needs its own
// close(). Move-only.
#pragma once

namespace lorastream {

class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) noexcept : fd_(fd) {}  // takes ownership; -1 holds nothing
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.Release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) Reset(other.Release());
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { Reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  // Gives the descriptor up without closing it.
  int Release() noexcept {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }
  // Closes the held descriptor (keeping errno: callers report the failure that led here) and
  // holds `fd` instead.
  void Reset(int fd = -1) noexcept;

 private:
  int fd_ = -1;
};

// pipe2(flags) as two owned ends; throws Error naming `what` when it fails.
struct UniquePipe {
  UniqueFd read_end;
  UniqueFd write_end;
};
UniquePipe MakePipe(int flags, const char* what);

}  // namespace lorastream
