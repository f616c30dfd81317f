// What every test folder shares: a temporary folder, a wait on a condition, the built
// executables. Tests wait on conditions, never on time: WaitFor polls until the condition
// holds or a deadline (a generous bound for a loaded machine, not an expected duration).
#pragma once

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

}  // namespace lorastream::testing
