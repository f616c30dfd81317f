// Helpers shared by the store tests: synthetic checkpoints, unique store
// names (tests of several people and runs may share /dev/shm).
#pragma once

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <string>

#include <catch2/catch.hpp>

#include "store/synth.h"
#include "tests/support/test_support.h"

namespace lorastream::testing {

inline std::string PresetsDir() { return std::string(LORASTREAM_SOURCE_DIR) + "/configs/models"; }

inline std::string UniqueName(const std::string& tag) {
  static std::atomic<int> counter{0};
  return "test-" + tag + "-" + std::to_string(::getpid()) + "-" + std::to_string(counter++);
}

inline store::SynthResult Synth(const std::string& preset, const std::string& out,
                                uint64_t seed = 1, const std::string& dtype = "",
                                uint64_t shard_bytes = 4ull << 30, int64_t layers = 0) {
  store::SynthOptions o;
  o.preset = preset;
  o.out_dir = out;
  o.presets_dir = PresetsDir();
  o.seed = seed;
  o.dtype = dtype;
  o.shard_bytes = shard_bytes;
  o.layers = layers;
  o.threads = 2;
  o.force = true;  // tests write into their own temporary folders, some more than once
  return store::RunSynth(o);
}

}  // namespace lorastream::testing
