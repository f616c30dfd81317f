// Test helpers for the streaming engine: a tiny Llama-shaped model's blocks packed as the
// store packs them (canonical tensor order, 256-byte aligned offsets, f32) into host buffers
// the test owns, and a manifest describing them.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/base/error.h"
#include "common/formats/manifest.h"
#include "common/formats/model_config.h"
#include "common/posix/memory_mapping.h"
#include "common/posix/unique_fd.h"
#include "store/shm_segment.h"

namespace lorastream::testing {

inline ModelConfig TinyStreamConfig(int layers) {
  ModelConfig c;
  c.model_type = "llama";
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_hidden_layers = layers;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  c.vocab_size = 64;
  c.max_position_embeddings = 64;
  c.torch_dtype = "float32";
  return c;
}

// Page-aligned host memory holding every block's bytes (one region per block, as the store's
// segments are). Like the store, each block is a shared-memory object (memfd) filled through a
// writable mapping; with `read_only` the block is then seen only through a PROT_READ
// MAP_SHARED mapping, exactly what a worker's attach gives (and what cudaHostRegister with
// the read-only flag is measured on in ../shared/GPU.md).
class HostBlocks {
 public:
  HostBlocks(const ModelConfig& config, uint64_t seed, bool read_only) {
    manifest_.store_name = "test";
    manifest_.config = config;
    manifest_.dtype = DType::kF32;
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.0f, 0.2f);
    for (int i = 0; i < config.num_hidden_layers; ++i) {
      SegmentInfo s = LayoutSegment(config.BlockTensorShapes(), "block" + std::to_string(i),
                                    DType::kF32, manifest_.alignment);
      const size_t mapped = store::RoundUpToPage(s.nbytes);
      UniqueFd fd(memfd_create(("lorastream-test-block" + std::to_string(i)).c_str(), MFD_CLOEXEC));
      LS_CHECK(fd.valid() && ftruncate(fd.get(), static_cast<off_t>(mapped)) == 0,
               "memfd for test blocks");
      MemoryMapping map = MemoryMapping::Map(mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(),
                                             0, "mmap for test blocks");
      uint8_t* bytes = map.bytes();
      for (const TensorSlice& t : s.tensors) {
        auto* f = reinterpret_cast<float*>(bytes + t.offset);
        const bool norm = t.name.find("norm") != std::string::npos;
        for (uint64_t k = 0; k < t.nbytes / 4; ++k) f[k] = norm ? 1.0f + normal(rng) : normal(rng);
      }
      if (read_only) {
        map = MemoryMapping::Map(mapped, PROT_READ, MAP_SHARED | MAP_POPULATE, fd.get(), 0,
                                 "read-only mmap for test blocks");
        bytes = map.bytes();
      }
      maps_.push_back(std::move(map));
      pointers_.push_back(bytes);
      manifest_.blocks.push_back(s);
    }
    manifest_.rest =
        LayoutSegment(config.RestTensorShapes(), "rest", DType::kF32, manifest_.alignment);
  }
  HostBlocks(const HostBlocks&) = delete;
  HostBlocks& operator=(const HostBlocks&) = delete;

  const Manifest& manifest() const { return manifest_; }
  const std::vector<const uint8_t*>& pointers() const { return pointers_; }

 private:
  Manifest manifest_;
  std::vector<const uint8_t*> pointers_;
  std::vector<MemoryMapping> maps_;
};

}  // namespace lorastream::testing
