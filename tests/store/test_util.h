// Helpers shared by the store tests: synthetic checkpoints, unique store
// names (tests of several people and runs may share /dev/shm).
#pragma once

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "common/formats/manifest.h"
#include "common/formats/quant_format.h"
#include "common/formats/safetensors.h"
#include "store/attach.h"
#include "store/quantize.h"
#include "store/server.h"
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

// `path` published as store `name` in this process (unlocked, two threads, compressed as
// `quantize` says); unpublished when the result is destroyed.
inline std::unique_ptr<store::PublishedStore> ServeInProcess(
    const std::string& path, const std::string& name, QuantMethod quantize = QuantMethod::kNone) {
  store::ServeOptions o;
  o.model_dir = path;
  o.name = name;
  o.threads = 2;
  o.lock = false;
  o.quantize = quantize;
  return store::PublishedStore::Build(o);
}

// Checks each block of compressed store `store` (manifest `m`, served from the f32 single file
// `source`) against the plain store of the same file: every compressed weight is one that
// `is_linear` names, holding ReferenceQuantized's bytes of the whole weight, its scales too;
// every other block tensor holds the plain store's bytes. Returns each block's count of
// compressed weights.
inline std::vector<int> CheckCompressedBlocks(
    const Manifest& m, const store::AttachedStore& store, const SafetensorsFile& source,
    const Manifest& plain, const store::AttachedStore& plain_store,
    const std::function<bool(const std::string&)>& is_linear) {
  std::vector<int> counts;
  for (size_t u = 0; u < m.blocks.size(); ++u) {
    int compressed = 0;
    const int b = static_cast<int>(u);
    for (const TensorSlice& t : m.blocks[u].tensors) {
      INFO(t.name);
      if (t.quant.compressed()) {
        ++compressed;
        CHECK(is_linear(t.name));
        const SafetensorsEntry* e = source.Find(t.name);
        REQUIRE(e != nullptr);
        const auto* src = reinterpret_cast<const float*>(source.Data(*e));
        const std::vector<float> w(src, src + e->numel());
        const auto want = ReferenceQuantized(w, t.shape[0], t.shape[1], t.quant);
        const auto aux = QuantAuxTensors(t.name, t.shape, t.quant);
        REQUIRE(want.size() == aux.size() + 1);
        CHECK(std::memcmp(store.tensor_data(b, t.name), want[0].data(), t.nbytes) == 0);
        for (size_t k = 0; k < aux.size(); ++k) {
          const TensorSlice* a = m.blocks[u].Find(aux[k].name);
          REQUIRE(a != nullptr);
          REQUIRE(a->nbytes == want[k + 1].size());
          CHECK(std::memcmp(store.tensor_data(b, a->name), want[k + 1].data(), a->nbytes) == 0);
        }
      } else if (const TensorSlice* p = plain.blocks[u].Find(t.name)) {
        REQUIRE(p->nbytes == t.nbytes);  // a norm or a bias: the plain store's bytes
        CHECK(std::memcmp(store.tensor_data(b, t.name), plain_store.tensor_data(b, t.name),
                          t.nbytes) == 0);
      }
    }
    counts.push_back(compressed);
  }
  return counts;
}

// Checks that store `store` (manifest `m`) of an fp8 file `source` holds each compressed
// weight as the file's bytes with scales of 1; returns how many there are.
inline int CheckFp8AsFile(const Manifest& m, const store::AttachedStore& store,
                          const SafetensorsFile& source) {
  int compressed = 0;
  for (size_t u = 0; u < m.blocks.size(); ++u)
    for (const TensorSlice& t : m.blocks[u].tensors) {
      if (!t.quant.compressed()) continue;
      INFO(t.name);
      ++compressed;
      const SafetensorsEntry* e = source.Find(t.name);
      REQUIRE(e != nullptr);
      CHECK(std::memcmp(store.tensor_data(static_cast<int>(u), t.name), source.Data(*e),
                        t.nbytes) == 0);
      const TensorSlice* scale = m.blocks[u].Find(t.name + "_scale_inv");
      REQUIRE(scale != nullptr);
      const auto* s =
          reinterpret_cast<const float*>(store.tensor_data(static_cast<int>(u), scale->name));
      for (uint64_t i = 0; i < scale->nbytes / 4; ++i) REQUIRE(s[i] == 1.0f);
    }
  return compressed;
}

}  // namespace lorastream::testing
