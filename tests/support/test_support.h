// What every test folder shares: a temporary folder, a wait on a condition, the built
// executables. Tests wait on conditions, never on time: WaitFor polls until the condition
// holds or a deadline (a generous bound for a loaded machine, not an expected duration).
#pragma once

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>

namespace lorastream::testing {

// A fresh folder /tmp/lorastream-<tag>-XXXXXX (mkdtemp: unique across processes and runs),
// removed with everything in it when it goes out of scope, unless LORASTREAM_KEEP_TEST_DIRS
// is set (to look at a failed test's logs). Move-only.
class TempDir {
 public:
  explicit TempDir(const std::string& tag);
  ~TempDir();
  TempDir(TempDir&& other) noexcept;
  TempDir& operator=(TempDir&&) = delete;
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::filesystem::path& path() const { return path_; }
  const std::string& str() const { return str_; }
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
  std::string str_;
};

// Polls `done` every `poll_ms` until it returns true (true) or `timeout_s` has passed
// (false, after one last try).
bool WaitFor(const std::function<bool()>& done, double timeout_s, int poll_ms = 20);

// The path of the built executable `name` (build/bin/); Error(kNotFound) naming the target
// to build when it is missing.
std::string Bin(const std::string& name);

// A complete checkpoint-<step>/ in `out` as the worker's SaveCheckpoint writes it, minus torch:
// adapter files, a trainer state with one moment tensor and `eval_loss`, the checksum
// manifest, then the rename. `recorded_step` >= 0 writes another step into the trainer state
// (a forged checkpoint). Returns the folder.
std::filesystem::path WriteTestCheckpoint(const std::filesystem::path& out, int64_t step,
                                          double eval_loss = NAN, int64_t recorded_step = -1);

// Whether writing one byte at `byte` kills a forked child with SIGSEGV: a read-only mapping
// (a store's segments as a worker sees them) faults on a write. The child dies with the
// default handler (not the test framework's); this process's bytes are untouched.
bool WriteFaults(const uint8_t* byte);

// Whether Node.js is here (LORASTREAM_NODE, or node / nodejs on PATH): `lorastream prepare`
// runs its tokenizer under node. tools/setup.sh installs it; a machine without a package
// archive (the GPU machine) may lack it, and the tests that need it say so and stop.
bool HaveNode();

}  // namespace lorastream::testing
