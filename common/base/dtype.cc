#include "common/base/dtype.h"

namespace lorastream {

namespace {
struct DTypeInfo {
  DType dtype;
  const char* name;
  size_t size;
};
constexpr DTypeInfo kDTypes[] = {
    {DType::kBool, "BOOL", 1}, {DType::kU8, "U8", 1},          {DType::kI8, "I8", 1},
    {DType::kI16, "I16", 2},   {DType::kU16, "U16", 2},        {DType::kI32, "I32", 4},
    {DType::kU32, "U32", 4},   {DType::kI64, "I64", 8},        {DType::kU64, "U64", 8},
    {DType::kF16, "F16", 2},   {DType::kBF16, "BF16", 2},      {DType::kF32, "F32", 4},
    {DType::kF64, "F64", 8},   {DType::kF8E4M3, "F8_E4M3", 1}, {DType::kF8E5M2, "F8_E5M2", 1},
};
}  // namespace

size_t DTypeSize(DType dtype) { return kDTypes[static_cast<int>(dtype)].size; }
const char* DTypeName(DType dtype) { return kDTypes[static_cast<int>(dtype)].name; }

std::optional<DType> ParseDType(const std::string& name) {
  for (const DTypeInfo& info : kDTypes)
    if (name == info.name) return info.dtype;
  return std::nullopt;
}

}  // namespace lorastream
