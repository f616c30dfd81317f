// lorastream-memcpy-bench BYTES [THREADS]: the baseline of tools/bench_store.sh — a plain
// memcpy of BYTES between two prefaulted buffers (split over THREADS), in GB/s, and the same
// into a fresh (not prefaulted) buffer.
#include <sys/mman.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: lorastream-memcpy-bench BYTES [THREADS]\n");
    return 2;
  }
  const size_t n = std::strtoull(argv[1], nullptr, 10);
  const int threads = argc > 2 ? std::atoi(argv[2]) : 1;
  auto alloc = [n] {
    void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (p == MAP_FAILED) std::exit(1);
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
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  // Cold: into a fresh mapping, paying a page fault per 4 KiB page as the store's first
  // touch of its new segments does.
  char* cold = static_cast<char*>(
      mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  if (cold == MAP_FAILED) return 1;
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      const size_t b = n * t / threads, e = n * (t + 1) / threads;
      std::memcpy(cold + b, src + b, e - b);
    });
  for (auto& th : pool) th.join();
  const double cold_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("memcpy bytes=%zu threads=%d seconds=%.4f gbps=%.3f cold_seconds=%.4f cold_gbps=%.3f\n",
              n, threads, best, n / best / 1e9, cold_s, n / cold_s / 1e9);
  return dst[n / 2] == 1 && cold[n / 3] == 1 ? 0 : 1;
}
