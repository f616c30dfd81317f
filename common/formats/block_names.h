// Helpers the diffusion families share for reading a checkpoint's tensor names: the blocks a
// prefix numbers ("double_blocks.N.", "transformer_blocks.N."), the RoPE axes a file's
// metadata declares, the complete-and-nothing-else check of a checkpoint against the tensor
// list of its shape. Torch-free.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/formats/safetensors.h"

namespace lorastream {

using TensorShapes = std::vector<std::pair<std::string, std::vector<int64_t>>>;

// A decimal integer of at most 18 digits (no sign, no space), else nullopt.
std::optional<int64_t> ParseDecimal(const std::string& text);

// The blocks under `prefix` (one more than the highest N of a tensor "PREFIXN.*"). Each index
// is checked by name: a number, below `max_blocks` and below the file's tensor count (each
// block has several); else Error(kCorrupt) naming `source` and the tensor.
int64_t CountNumberedBlocks(const SafetensorsHeader& h, const std::string& prefix,
                            int64_t max_blocks, const std::string& source);

// Whether `name` is "PREFIXN.REST" with N at most nine digits; REST into *rest.
bool SplitNumberedName(const std::string& name, const std::string& prefix, std::string* rest);

// RoPE axes written "16,56,56" under metadata key `key`: three positive even numbers of at
// most `head_dim` each; else Error(kCorrupt) naming `source` and the key.
std::array<int64_t, 3> ParseAxesDim(const std::string& text, const std::string& key,
                                    int64_t head_dim, const std::string& source);

// The shape of tensor `name` among `h`'s, or nullptr.
const std::vector<int64_t>* HeaderShape(const SafetensorsHeader& h, const std::string& name);

// Every tensor of `want` present in `have` (name, shape) with its shape, none extra:
// Error(kCorrupt) naming `source` and the first tensor missing, misshapen or unexpected
// (`model` says whose tensors were expected: "FLUX.1's transformer").
void RequireExactTensors(const TensorShapes& have, const TensorShapes& want,
                         const std::string& source, const std::string& model);

// `spec` when every name is one of `known`; else (or when empty) Error(kRefused) naming
// `where` and the unknown name, listing `presets` ("all", "attention") and `known`
// (`model`: "a FLUX block").
const std::vector<std::string>& RequireKnownTargets(const std::vector<std::string>& spec,
                                                    const std::vector<std::string>& known,
                                                    const std::string& presets,
                                                    const std::string& model,
                                                    const std::string& where);

}  // namespace lorastream
