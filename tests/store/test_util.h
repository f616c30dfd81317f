// Helpers shared by the store tests: synthetic checkpoints, unique store
// names (tests of several people and runs may share /dev/shm).
#pragma once

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "common/quant_format.h"
#include "store/quantize.h"
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

// The bytes `serve --quantize` must store for weight `w` ([rows, cols] f32) in `quant`: the
// weight and each of its scales (QuantAuxTensors order), from store/quantize.h's functions
// applied to the whole weight at once.
inline std::vector<std::vector<uint8_t>> ReferenceQuantized(const std::vector<float>& w,
                                                            int64_t rows, int64_t cols,
                                                            const QuantInfo& quant) {
  auto bytes_of = [](const auto& v) {
    const auto* p = reinterpret_cast<const uint8_t*>(v.data());
    return std::vector<uint8_t>(p, p + v.size() * sizeof(v[0]));
  };
  if (quant.method == QuantMethod::kFp8) {
    const int64_t tiles = (cols + quant.block_cols - 1) / quant.block_cols;
    std::vector<uint8_t> q(rows * cols);
    std::vector<float> scale(((rows + quant.block_rows - 1) / quant.block_rows) * tiles);
    for (int64_t r = 0; r < rows; r += quant.block_rows)
      store::QuantizeFp8Band(w.data() + r * cols, std::min(quant.block_rows, rows - r), cols,
                             quant.block_cols, q.data() + r * cols,
                             scale.data() + r / quant.block_rows * tiles);
    return {q, bytes_of(scale)};
  }
  const int64_t n = rows * cols, blocks = (n + quant.blocksize - 1) / quant.blocksize;
  std::vector<uint8_t> packed(n / 2), absmax_q(blocks);
  std::vector<float> absmax(blocks),
      nested((blocks + quant.nested_blocksize - 1) / quant.nested_blocksize), offset(1);
  store::QuantizeNf4(w.data(), n, quant.blocksize, packed.data(), absmax.data());
  store::DoubleQuantizeAbsmax(absmax.data(), blocks, quant.nested_blocksize, absmax_q.data(),
                              nested.data(), offset.data());
  return {
      packed,
      absmax_q,
      bytes_of(nested),
      bytes_of(std::vector<float>(store::kNf4Code.begin(), store::kNf4Code.end())),
      bytes_of(std::vector<float>(store::DynamicMap8Bit().begin(), store::DynamicMap8Bit().end())),
      bytes_of(offset)};
}

}  // namespace lorastream::testing
