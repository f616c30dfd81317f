// Element types of safetensors files and of the store (torch-free).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

namespace lorastream {

enum class DType : uint8_t {
  kBool,
  kU8,
  kI8,
  kI16,
  kU16,
  kI32,
  kU32,
  kI64,
  kU64,
  kF16,
  kBF16,
  kF32,
  kF64,
  kF8E4M3,
  kF8E5M2,
};

// Bytes per element.
size_t DTypeSize(DType dtype);
// The safetensors spelling ("BF16", "F32", "F8_E4M3", ...).
const char* DTypeName(DType dtype);
// Parses a safetensors spelling; nullopt when unknown.
std::optional<DType> ParseDType(const std::string& name);

}  // namespace lorastream
