// lorastream-memcpy-bench BYTES [THREADS]: the baseline of tools/bench_store.sh — a plain
// memcpy of BYTES between two prefaulted buffers (split over THREADS), in GB/s, and the same
// into a fresh (not prefaulted) buffer.
#include <sys/mman.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>

#include "common/base/cli_main.h"
#include "common/base/error.h"

namespace {

int RunMemcpyBench(size_t n, int threads) {
  auto alloc = [n] {
    void* p =
        mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (p == MAP_FAILED) lorastream::ThrowErrno("mmap of " + std::to_string(n) + " bytes");
    return static_cast<char*>(p);
  };
  char* src = alloc();
  char* dst = alloc();
  std::memset(src, 1, n);
  std::memset(dst, 0, n);  // both fully faulted in and written before timing
  double best = 1e9;
  for (int rep = 0; rep < 3; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t)
      pool.emplace_back([&, t] {
        const size_t b = n * t / threads, e = n * (t + 1) / threads;
        std::memcpy(dst + b, src + b, e - b);
      });
    for (auto& th : pool) th.join();
    best = std::min(best,
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  // Cold: into a fresh mapping, paying a page fault per 4 KiB page as the store's first
  // touch of its new segments does.
  void* cold_map = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (cold_map == MAP_FAILED) lorastream::ThrowErrno("mmap of " + std::to_string(n) + " bytes");
  char* cold = static_cast<char*>(cold_map);
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      const size_t b = n * t / threads, e = n * (t + 1) / threads;
      std::memcpy(cold + b, src + b, e - b);
    });
  for (auto& th : pool) th.join();
  const double cold_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf(
      "memcpy bytes=%zu threads=%d seconds=%.4f gbps=%.3f cold_seconds=%.4f cold_gbps=%.3f\n", n,
      threads, best, n / best / 1e9, cold_s, n / cold_s / 1e9);
  return dst[n / 2] == 1 && cold[n / 3] == 1 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"lorastream-memcpy-bench: memcpy bandwidth, the store benchmark's baseline"};
  size_t bytes = 0;
  int threads = 1;
  app.add_option("BYTES", bytes, "bytes to copy")->required()->check(CLI::PositiveNumber);
  app.add_option("THREADS", threads, "copying threads")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  return lorastream::RunMain("lorastream-memcpy-bench", app, argc, argv,
                             [&] { return RunMemcpyBench(bytes, threads); });
}
