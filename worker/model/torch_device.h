// The typed device (common/base/device.h) as LibTorch names it: the one place where the worker's
// torch files get a c10::Device (a compute dtype's c10::ScalarType: ScalarTypeOf in
// worker/model/base_weights.h).
#pragma once

#include <c10/core/Device.h>

#include "common/base/device.h"

namespace lorastream::worker {

inline c10::Device TorchDevice(const Device& device) {
  return device.is_cuda()
             ? c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device.index))
             : c10::Device(c10::DeviceType::CPU);
}

}  // namespace lorastream::worker
