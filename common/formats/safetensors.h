// safetensors reading (mmap, validated before trusted) and writing (aligned, with metadata),
// single files and sharded checkpoints (model.safetensors.index.json). Torch-free.
//
// Format: 8-byte little-endian header length N, N bytes of JSON
// {"name": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {..}},
// then the data section; offsets are relative to the data section.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/base/dtype.h"
#include "common/formats/model_config.h"
#include "common/posix/memory_mapping.h"

namespace lorastream {

// Largest header accepted (safetensors' own reader caps it at 100 MB too).
constexpr uint64_t kMaxSafetensorsHeaderBytes = 100ull << 20;

struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte range within the data section
  uint64_t end = 0;
  uint64_t nbytes() const { return end - begin; }
  uint64_t numel() const;
};

// "[32, 128]": a shape as every message about tensors writes it.
std::string ShapeString(const std::vector<int64_t>& shape);

struct SafetensorsHeader {
  std::vector<SafetensorsEntry> tensors;  // sorted by begin offset
  std::map<std::string, std::string> metadata;
  uint64_t data_offset = 0;  // 8 + N: where the data section starts in the file
};

// Validates and parses the header of a safetensors image of `size` bytes (only the first
// 8 + N bytes are read; N is checked against `size`). Every failure throws Error(kCorrupt)
// naming `source` and, where there is one, the tensor. Used by the reader and the fuzzer.
SafetensorsHeader ParseSafetensorsHeader(const uint8_t* data, size_t size,
                                         const std::string& source);

// A read-only memory mapping of one validated .safetensors file. Move-only.
class SafetensorsFile {
 public:
  static SafetensorsFile Open(const std::string& path);
  SafetensorsFile(SafetensorsFile&&) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&&) noexcept;
  ~SafetensorsFile();

  const std::string& path() const { return path_; }
  const SafetensorsHeader& header() const { return header_; }
  const std::vector<SafetensorsEntry>& tensors() const { return header_.tensors; }
  const SafetensorsEntry* Find(const std::string& name) const;  // nullptr when absent
  // The tensor's bytes inside the mapping.
  const uint8_t* Data(const SafetensorsEntry& entry) const;

 private:
  SafetensorsFile() = default;
  std::string path_;
  SafetensorsHeader header_;
  MemoryMapping mapping_;
};

// A run of rows of a model's tensor as a checkpoint holds it: the tensor's rows
// [row, row + rows) are the checkpoint tensor `entry`'s rows [source_row, source_row + rows)
// in `file` (one piece covering it all when the checkpoint holds the tensor whole).
struct SafetensorsRows {
  const SafetensorsFile* file = nullptr;
  const SafetensorsEntry* entry = nullptr;
  int64_t source_row = 0, row = 0, rows = 0;
};

// The tensors of a folder stored as STEM.safetensors or as the shards that
// STEM.safetensors.index.json lists (every listed shard must exist and hold the tensors the
// index assigns it; no tensor may appear twice): Hugging Face's model.*, diffusers'
// diffusion_pytorch_model.*.
class SafetensorsFolder {
 public:
  static SafetensorsFolder Open(const std::string& dir, const std::string& stem);
  const std::string& dir() const { return dir_; }
  struct Ref {
    const SafetensorsFile* file;
    const SafetensorsEntry* entry;
  };
  // Every tensor of every shard, in file order.
  std::vector<Ref> AllTensors() const;
  // Throws Error(kNotFound) naming the tensor and the folder when absent.
  Ref Get(const std::string& name) const;
  bool Has(const std::string& name) const;

 private:
  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, Ref> by_name_;
};

// A Hugging Face checkpoint folder: config.json plus model.safetensors, or shards listed in
// model.safetensors.index.json (SafetensorsFolder's checks).
class Checkpoint {
 public:
  static Checkpoint Open(const std::string& dir);
  const std::string& dir() const { return dir_; }
  const ModelConfig& config() const { return config_; }
  using Ref = SafetensorsFolder::Ref;
  // Every tensor of every shard, in file order.
  std::vector<Ref> AllTensors() const;
  // Throws Error(kNotFound) naming the tensor and the folder when absent.
  Ref Get(const std::string& name) const;
  bool Has(const std::string& name) const;

 private:
  std::string dir_;
  ModelConfig config_;
  SafetensorsFolder tensors_;
};

struct TensorToWrite {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  const void* data = nullptr;  // nbytes = numel * DTypeSize(dtype)
};

// Writes a .safetensors file: tensors in the given order, contiguous (as the reference reader
// requires), the header padded with spaces so that the data section starts on an `alignment`
// boundary. Writes to a temporary name and renames, so a reader never sees half a file.
void WriteSafetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                      const std::map<std::string, std::string>& metadata = {},
                      size_t alignment = 64);

// Streaming variant for files larger than memory (lorastream-synth): `fill(index, offset, out,
// n)` writes bytes [offset, offset + n) of tensors[index] into `out`; it is called in file
// order, in chunks of at most `chunk_bytes`. `data` of the entries is ignored.
using TensorFiller = std::function<void(size_t index, uint64_t offset, uint8_t* out, size_t n)>;
void WriteSafetensorsStreamed(const std::string& path, const std::vector<TensorToWrite>& tensors,
                              const TensorFiller& fill,
                              const std::map<std::string, std::string>& metadata = {},
                              size_t alignment = 64, size_t chunk_bytes = 64u << 20);

// Total data-section bytes of a file WriteSafetensors would write (used to plan shards).
uint64_t TensorBytes(const TensorToWrite& tensor);

}  // namespace lorastream
