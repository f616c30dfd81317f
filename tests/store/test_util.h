// Helpers shared by the store tests: temporary folders, synthetic checkpoints, unique store
// names (tests of several people and runs may share /dev/shm).
#pragma once

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <string>

#include <catch2/catch.hpp>

#include "common/remove_tree.h"
#include "store/synth.h"

namespace lorastream::testing {

inline std::string TempDir() {
  char templ[] = "/tmp/lorastream_store_XXXXXX";
  REQUIRE(mkdtemp(templ) != nullptr);
  return templ;
}

// Removes a folder tree when the test ends.
struct ScopedDir {
  std::string path = TempDir();
  ~ScopedDir() { RemoveTree(path); }
};

inline std::string PresetsDir() { return std::string(LORASTREAM_SOURCE_DIR) + "/configs/models"; }
inline std::string Bin(const std::string& name) { return std::string(LORASTREAM_BIN_DIR) + "/" + name; }

inline std::string UniqueName(const std::string& tag) {
  static std::atomic<int> counter{0};
  return "test-" + tag + "-" + std::to_string(::getpid()) + "-" + std::to_string(counter++);
}

inline SynthResult Synth(const std::string& preset, const std::string& out, uint64_t seed = 1,
                         const std::string& dtype = "", uint64_t shard_bytes = 4ull << 30,
                         int64_t layers = 0) {
  SynthOptions o;
  o.preset = preset;
  o.out_dir = out;
  o.presets_dir = PresetsDir();
  o.seed = seed;
  o.dtype = dtype;
  o.shard_bytes = shard_bytes;
  o.layers = layers;
  o.threads = 2;
  return RunSynth(o);
}

}  // namespace lorastream::testing
