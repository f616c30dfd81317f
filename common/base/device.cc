#include "common/base/device.h"

#include <charconv>

#include "common/base/error.h"

namespace lorastream {

std::string Device::str() const { return is_cuda() ? "cuda:" + std::to_string(index) : "cpu"; }

Device ParseDevice(const std::string& text, const std::string& what) {
  if (text == "cpu") return Device{};
  if (text == "cuda") return Device{Device::Kind::kCuda, 0};
  const std::string prefix = "cuda:";
  if (text.size() > prefix.size() && text.compare(0, prefix.size(), prefix) == 0) {
    int index = -1;
    const char* begin = text.data() + prefix.size();
    const char* end = text.data() + text.size();
    const auto [stop, ec] = std::from_chars(begin, end, index);
    if (ec == std::errc() && stop == end && index >= 0) return Device{Device::Kind::kCuda, index};
  }
  throw Error(ErrorCode::kInvalidArgument,
              what + " `" + text + "` is not a device (cpu, cuda, cuda:N)");
}

std::optional<DType> ParseShortDType(const std::string& name) {
  for (DType d : {DType::kF32, DType::kF16, DType::kBF16})
    if (name == ShortDTypeName(d)) return d;
  return std::nullopt;
}

const char* ShortDTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "f32";
    case DType::kF16:
      return "f16";
    case DType::kBF16:
      return "bf16";
    default:
      return "";
  }
}

bool IsComputeDType(DType dtype) { return dtype == DType::kF32 || dtype == DType::kBF16; }

std::optional<DType> ParseComputeDType(const std::string& text, const Device& device) {
  if (text == "auto") return device.is_cuda() ? DType::kBF16 : DType::kF32;
  if (const std::optional<DType> d = ParseShortDType(text); d && IsComputeDType(*d)) return d;
  return std::nullopt;
}

DType ComputeDType(const std::string& text, const Device& device, const std::string& what) {
  if (const std::optional<DType> d = ParseComputeDType(text, device)) return *d;
  throw Error(ErrorCode::kInvalidArgument,
              what + " `" + text + "` is not a compute dtype (auto, f32, bf16)");
}

}  // namespace lorastream
