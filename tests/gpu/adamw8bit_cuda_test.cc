// AdamW with 8-bit moments on CUDA: its one-kernel step (worker/train/cuda/adamw8bit_kernel.cu)
// against the ATen path on the CPU, over parameters of mixed sizes (a padded last block, one
// with f32 moments, one skipped at a step), and the state it leaves.
#include <vector>

#include <ATen/ATen.h>

#include <catch2/catch.hpp>

#include "worker/train/adamw.h"

using namespace lorastream::worker;

namespace {

std::vector<at::Tensor> Params(const at::Device& device) {
  at::manual_seed(21);
  std::vector<at::Tensor> p = {at::randn({16, 512}), at::randn({128, 63}), at::randn({8, 16}),
                               at::randn({64, 96})};
  for (auto& t : p) t = t.to(device).requires_grad_(true);
  return p;
}

}  // namespace

TEST_CASE("adamw8bit: the CUDA kernel's step follows the ATen path", "[gpu]") {
  const at::Device cuda(at::kCUDA, 0);
  std::vector<at::Tensor> gpu = Params(cuda), cpu = Params(at::kCPU), f32 = Params(at::kCPU),
                          start = Params(at::kCPU);
  AdamWOptions eight;
  eight.weight_decay = 0.05;
  eight.eight_bit = true;
  AdamWOptions plain = eight;
  plain.eight_bit = false;
  AdamW opt_gpu(gpu, eight), opt_cpu(cpu, eight), opt_f32(f32, plain);
  REQUIRE(opt_gpu.eight_bit(0));
  REQUIRE(opt_gpu.eight_bit(1));  // 8064 elements: its last block padded
  REQUIRE(!opt_gpu.eight_bit(2));
  for (int step = 0; step < 12; ++step) {
    at::manual_seed(100 + step);
    for (size_t i = 0; i < cpu.size(); ++i) {
      const at::Tensor g = at::randn(cpu[i].sizes()) * (0.1 + at::rand({cpu[i].size(0), 1}));
      // Tensor 3 has no gradient at step 5: it and its moments stay as they were.
      const bool none = i == 3 && step == 5;
      gpu[i].mutable_grad() = none ? at::Tensor() : g.to(cuda);
      cpu[i].mutable_grad() = none ? at::Tensor() : g.clone();
      f32[i].mutable_grad() = none ? at::Tensor() : g.clone();
    }
    const at::Tensor before = gpu[3].detach().cpu();
    opt_gpu.Step(1e-3);
    opt_cpu.Step(1e-3);
    opt_f32.Step(1e-3);
    if (step == 5) CHECK(at::equal(gpu[3].detach().cpu(), before));
  }
  for (size_t i = 0; i < cpu.size(); ++i) {
    const at::Tensor g = gpu[i].detach().cpu(), c = cpu[i].detach(), f = f32[i].detach();
    const double moved = (c - start[i]).norm().item<double>();
    const double kernel_apart = (g - c).norm().item<double>();
    const double eight_bit_apart = (c - f).norm().item<double>();
    INFO("tensor " << i << ": moved " << moved << ", kernel from ATen " << kernel_apart
                   << ", 8-bit from f32 " << eight_bit_apart);
    CHECK(moved > 0);
    if (!opt_gpu.eight_bit(i)) {
      // f32 moments: torch's arithmetic on both devices.
      CHECK(kernel_apart < 1e-5 * moved);
      continue;
    }
    // The kernel and the ATen path differ where a moment lies at a midpoint between two entries
    // within f32 rounding: far less than 8 bits differ from f32.
    CHECK(kernel_apart < 0.01 * moved);
    CHECK(kernel_apart < 0.5 * eight_bit_apart);
    for (int which = 0; which < 2; ++which) {
      const at::Tensor mg = opt_gpu.Moment(i, which).cpu(), mc = opt_cpu.Moment(i, which);
      CHECK((mg - mc).norm().item<double>() < 0.01 * mc.norm().item<double>());
    }
  }
}
