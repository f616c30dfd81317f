// The NVIDIA GPUs of this host, without CUDA or LibTorch: `nvidia-smi` when it answers, else
// the driver's /proc/driver/nvidia/gpus/ (one folder per GPU). `lorastream up` starts one
// worker per GPU from it, `doctor` shows it, and a CPU-only build refuses to start CUDA
// workers on a host that has GPUs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace lorastream {

struct GpuInfo {
  int index = 0;
  std::string name;                // "NVIDIA H200" ("" when unknown)
  uint64_t memory_total = 0;       // bytes; 0 when unknown (no nvidia-smi)
  uint64_t memory_used = 0;        // bytes
  std::string compute_capability;  // "9.0" ("" when unknown)
};

// Every GPU of the host (CUDA_VISIBLE_DEVICES is not applied here). Tests replace the host by
// setting LORASTREAM_NVIDIA_GPUS_DIR to a folder to scan instead of /proc/driver/nvidia/gpus
// (one entry per GPU, optionally holding an `information` file with a `Model:` line);
// nvidia-smi is not asked then.
std::vector<GpuInfo> ListGpus();

// The GPUs a CUDA process would see: ListGpus() renumbered through CUDA_VISIBLE_DEVICES
// ("" or "-1" hides every GPU), as "cuda:0", "cuda:1", ...
std::vector<std::string> VisibleCudaDevices();

}  // namespace lorastream
