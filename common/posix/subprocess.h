// Child processes for `lorastream up` and the multi-process tests. RAII: a Subprocess that
// is still running when destroyed is stopped (SIGTERM, then SIGKILL after a grace period)
// unless it was detached. Move-only.
//
// A destructor does not run when its process is killed, so by default a child also gets
// SIGTERM from the kernel when its parent dies (PR_SET_PDEATHSIG): a killed test or a killed
// `lorastream up` leaves no store, coordinator or worker behind. SIGTERM rather than SIGKILL:
// every lorastream process ends cleanly on it (the store unlinks its shared memory, a
// training worker checkpoints), which SIGKILL would not let it do.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

namespace lorastream {

struct SpawnOptions {
  std::string log_path;                // stdout+stderr appended here ("" = inherit)
  std::vector<std::string> extra_env;  // "KEY=VALUE" added to the environment
  bool new_session = false;            // setsid(): not killed with our process group
  // SIGTERM to the child when the parent dies. Linux sends it when the *thread* that called
  // Spawn ends, not the process: spawn from a thread that outlives the child (the main
  // thread), or set this to false. False for a child meant to outlive us (`lorastream up
  // --keep`).
  bool die_with_parent = true;
};

class Subprocess {
 public:
  // Starts argv[0] (searched in PATH when it has no slash). Throws Error(kIo) when the
  // program cannot be started (exec failure is reported, not a silent exit 127).
  static Subprocess Spawn(const std::vector<std::string>& argv, const SpawnOptions& options = {});

  Subprocess() = default;
  Subprocess(Subprocess&& other) noexcept;
  Subprocess& operator=(Subprocess&& other) noexcept;
  ~Subprocess();

  pid_t pid() const { return pid_; }
  bool valid() const { return pid_ > 0; }
  // True while the child has not exited (reaps it when it has).
  bool Running();
  // Waits up to timeout_s (< 0: forever). Returns the exit code, or 128 + signal when killed
  // by a signal, or -1 on timeout (the child keeps running).
  int Wait(double timeout_s = -1);
  void Signal(int sig);
  // SIGTERM, waits grace_s, then SIGKILL; returns what Wait returns.
  int Stop(double grace_s = 10);
  // Forget the child: the destructor will not stop it.
  void Detach() { pid_ = -1; }

 private:
  friend std::string RunAndCapture(const std::vector<std::string>&, int*, double,
                                   const std::string&);
  explicit Subprocess(pid_t pid) : pid_(pid) {}
  pid_t pid_ = -1;
  int status_ = -1;  // set once reaped
};

// Runs argv to completion (at most timeout_s), returns its stdout; *exit_code gets what
// Subprocess::Wait returns. stderr goes to `stderr_path` ("" = inherited).
std::string RunAndCapture(const std::vector<std::string>& argv, int* exit_code,
                          double timeout_s = 600, const std::string& stderr_path = "");

}  // namespace lorastream
