#include "common/posix/subprocess.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

#include "common/base/error.h"
#include "common/posix/unique_fd.h"

extern char** environ;

namespace lorastream {

namespace {

int DecodeStatus(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

// Forks and execs; the child reports an exec failure through a close-on-exec pipe so the
// parent can throw a clear error instead of seeing a mysterious exit code.
pid_t ForkExec(const std::vector<std::string>& argv, const SpawnOptions& options, int stdout_fd) {
  if (argv.empty()) throw Error(ErrorCode::kInvalidArgument, "Subprocess: empty argv");
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  std::vector<std::string> env_strings;
  for (char** e = environ; *e; ++e) env_strings.emplace_back(*e);
  for (const auto& e : options.extra_env) env_strings.push_back(e);
  std::vector<char*> env;
  for (auto& e : env_strings) env.push_back(e.data());
  env.push_back(nullptr);

  // Owned, so that a failing pipe2 or fork leaves no descriptor behind.
  UniqueFd log_fd;
  if (!options.log_path.empty()) {
    log_fd.Reset(open(options.log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644));
    if (!log_fd.valid()) ThrowErrno("cannot open log file " + options.log_path);
  }
  UniquePipe report = MakePipe(O_CLOEXEC, "pipe");
  const pid_t parent = getpid();
  pid_t pid = fork();
  if (pid < 0) ThrowErrno("fork");
  if (pid == 0) {
    if (options.die_with_parent) {
      // The signal is armed only now: a parent that died since fork() (we were reparented)
      // would never send it, so this child ends as it would have been ended.
      prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (getppid() != parent) _exit(128 + SIGTERM);
    }
    if (options.new_session) setsid();
    if (log_fd.valid()) {
      dup2(log_fd.get(), STDOUT_FILENO);
      dup2(log_fd.get(), STDERR_FILENO);
    }
    if (stdout_fd >= 0) dup2(stdout_fd, STDOUT_FILENO);
    signal(SIGPIPE, SIG_DFL);
    execvpe(args[0], args.data(), env.data());
    int err = errno;
    ssize_t ignored = write(report.write_end.get(), &err, sizeof err);
    (void)ignored;
    _exit(127);
  }
  report.write_end.Reset();  // now only the child's copy (closed by exec) keeps it open
  log_fd.Reset();
  int child_errno = 0;
  ssize_t n;
  do {
    n = read(report.read_end.get(), &child_errno, sizeof child_errno);
  } while (n < 0 && errno == EINTR);
  report.read_end.Reset();
  if (n == sizeof child_errno) {
    waitpid(pid, nullptr, 0);
    throw Error(ErrorCode::kIo, "cannot start " + argv[0] + ": " + std::strerror(child_errno));
  }
  return pid;
}

}  // namespace

Subprocess Subprocess::Spawn(const std::vector<std::string>& argv, const SpawnOptions& options) {
  return Subprocess(ForkExec(argv, options, -1));
}

Subprocess::Subprocess(Subprocess&& other) noexcept : pid_(other.pid_), status_(other.status_) {
  other.pid_ = -1;
}

Subprocess& Subprocess::operator=(Subprocess&& other) noexcept {
  if (this != &other) {
    if (pid_ > 0 && status_ < 0) Stop(5);
    pid_ = other.pid_;
    status_ = other.status_;
    other.pid_ = -1;
  }
  return *this;
}

Subprocess::~Subprocess() {
  if (pid_ > 0 && status_ < 0) Stop(5);
}

bool Subprocess::Running() {
  if (pid_ <= 0 || status_ >= 0) return false;
  int status = 0;
  pid_t r = waitpid(pid_, &status, WNOHANG);
  if (r == pid_) {
    status_ = DecodeStatus(status);
    return false;
  }
  return r == 0;
}

int Subprocess::Wait(double timeout_s) {
  if (pid_ <= 0) return -1;
  if (status_ >= 0) return status_;
  if (timeout_s < 0) {
    int status = 0;
    while (waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
    status_ = DecodeStatus(status);
    return status_;
  }
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (Running()) {
    if (std::chrono::steady_clock::now() >= deadline) return -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return status_;
}

void Subprocess::Signal(int sig) {
  if (pid_ > 0 && status_ < 0) kill(pid_, sig);
}

int Subprocess::Stop(double grace_s) {
  if (pid_ <= 0) return -1;
  if (!Running()) return status_;
  Signal(SIGTERM);
  int code = Wait(grace_s);
  if (code == -1) {
    Signal(SIGKILL);
    code = Wait();
  }
  return code;
}

std::string RunAndCapture(const std::vector<std::string>& argv, int* exit_code, double timeout_s,
                          const std::string& stderr_path) {
  UniquePipe out = MakePipe(O_CLOEXEC, "pipe");
  SpawnOptions options;
  options.log_path = stderr_path;
  Subprocess child(ForkExec(argv, options, out.write_end.get()));
  out.write_end.Reset();  // the child holds its own copy: EOF comes when it exits
  std::string output;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  char buffer[4096];
  for (;;) {
    pollfd pfd{out.read_end.get(), POLLIN, 0};
    int ready = poll(&pfd, 1, 100);
    if (ready > 0) {
      ssize_t n = read(out.read_end.get(), buffer, sizeof buffer);
      if (n > 0) {
        output.append(buffer, static_cast<size_t>(n));
        continue;
      }
      if (n == 0 || errno != EINTR) break;
    }
    if (std::chrono::steady_clock::now() >= deadline) break;
  }
  out.read_end.Reset();
  double left = std::chrono::duration<double>(deadline - std::chrono::steady_clock::now()).count();
  int code = child.Wait(left > 0 ? left : 0);
  if (code == -1) code = child.Stop(1);  // ran past its time
  if (exit_code) *exit_code = code;
  return output;
}

}  // namespace lorastream
