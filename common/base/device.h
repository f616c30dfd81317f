// A compute device as command lines, job runs and worker registrations name it: "cpu", "cuda"
// (the first GPU) or "cuda:N" — parsed in one place (torch-free; the worker turns it into a
// c10::Device in worker/model/torch_device.h) — and the dtypes as job files and command lines spell
// them ("f32", "f16", "bf16"; the compute dtype a job runs in on a device).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "common/base/dtype.h"

namespace lorastream {

struct Device {
  enum class Kind : uint8_t { kCpu, kCuda };
  Kind kind = Kind::kCpu;
  int index = 0;  // the GPU's index (0 on the CPU)

  bool is_cuda() const { return kind == Kind::kCuda; }
  std::string str() const;  // "cpu" | "cuda:N"
};

// Error(kInvalidArgument) "WHAT `TEXT` is not a device (cpu, cuda, cuda:N)" for anything else.
Device ParseDevice(const std::string& text, const std::string& what = "--device");

// The short spellings of job files and command lines: "f32", "f16", "bf16" (nullopt for any
// other text, and "" from ShortDTypeName for the other dtypes).
std::optional<DType> ParseShortDType(const std::string& name);
const char* ShortDTypeName(DType dtype);
// The dtypes the worker computes in: f32 and bf16.
bool IsComputeDType(DType dtype);

// The dtype a job computes in, from train.dtype's spelling: "f32", "bf16", or "auto" (bf16 on
// a GPU, f32 on the CPU); nullopt for any other text.
std::optional<DType> ParseComputeDType(const std::string& text, const Device& device);
// The same, Error(kInvalidArgument) naming `what` and the text for any other.
DType ComputeDType(const std::string& text, const Device& device,
                   const std::string& what = "train.dtype");

}  // namespace lorastream
