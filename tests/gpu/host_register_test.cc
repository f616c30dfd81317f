// A process maps a shared-memory object created by ANOTHER process read-only, registers it
// with CUDA as read-only host memory, copies it to the GPU through LibTorch and checks the
// bytes. This is the foundation the store/worker split stands on (../shared/GPU.md).
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>

#include <ATen/ATen.h>
#include <cuda_runtime.h>

#include <catch2/catch.hpp>

namespace {

uint8_t PatternByte(size_t i) { return static_cast<uint8_t>((i * 2654435761u) >> 13); }

// Forks (before this process touches CUDA) a child that creates and fills a shm object,
// then waits on a pipe until the parent says it is done with it.
struct ShmOwnerProcess {
  pid_t pid = -1;
  int release_fd = -1;
  ShmOwnerProcess(const std::string& name, size_t bytes) {
    int ready[2], release[2];
    REQUIRE(pipe(ready) == 0);
    REQUIRE(pipe(release) == 0);
    pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      close(ready[0]);
      close(release[1]);
      int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
      if (fd < 0 || ftruncate(fd, static_cast<off_t>(bytes)) != 0) _exit(2);
      auto* p =
          static_cast<uint8_t*>(mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
      if (p == MAP_FAILED) _exit(3);
      for (size_t i = 0; i < bytes; ++i) p[i] = PatternByte(i);
      char c = 1;
      if (write(ready[1], &c, 1) != 1) _exit(4);
      if (read(release[0], &c, 1) < 0) _exit(5);  // parent closes -> EOF
      shm_unlink(name.c_str());
      _exit(0);
    }
    close(ready[1]);
    close(release[0]);
    release_fd = release[1];
    char c = 0;
    REQUIRE(read(ready[0], &c, 1) == 1);
    close(ready[0]);
  }
  int Finish() {
    close(release_fd);
    int status = 0;
    waitpid(pid, &status, 0);
    return status;
  }
};

}  // namespace

TEST_CASE("read-only shm from another process registers with CUDA and copies exactly", "[gpu]") {
  const size_t bytes = size_t{256} << 20;
  const std::string name = "/lorastream-gpu-test-" + std::to_string(getpid());
  ShmOwnerProcess owner(name, bytes);

  int fd = shm_open(name.c_str(), O_RDONLY, 0);
  REQUIRE(fd >= 0);
  void* map = mmap(nullptr, bytes, PROT_READ, MAP_SHARED | MAP_POPULATE, fd, 0);
  close(fd);
  REQUIRE(map != MAP_FAILED);

  int devices = 0;
  REQUIRE(cudaGetDeviceCount(&devices) == cudaSuccess);
  REQUIRE(devices > 0);
  REQUIRE(cudaFree(nullptr) == cudaSuccess);  // create the context outside the timing

  // Registering a PROT_READ mapping without the read-only flag fails on this driver; the
  // read-only flag is what lets workers pin memory they cannot write.
  auto t0 = std::chrono::steady_clock::now();
  cudaError_t err =
      cudaHostRegister(map, bytes, cudaHostRegisterReadOnly | cudaHostRegisterPortable);
  double reg_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  INFO("cudaHostRegister: " << cudaGetErrorString(err));
  REQUIRE(err == cudaSuccess);

  at::Tensor host =
      at::from_blob(map, {static_cast<int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte));
  at::Tensor device = at::empty({static_cast<int64_t>(bytes)},
                                at::TensorOptions().dtype(at::kByte).device(at::kCUDA));
  device.copy_(host, /*non_blocking=*/true);  // warm-up
  cudaDeviceSynchronize();
  const int reps = 5;
  auto t1 = std::chrono::steady_clock::now();
  for (int i = 0; i < reps; ++i) device.copy_(host, /*non_blocking=*/true);
  cudaDeviceSynchronize();
  double copy_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();

  // LibTorch sees registered memory as pinned once its CUDA state is up (after a copy).
  CHECK(host.is_pinned());
  at::Tensor back = device.cpu();
  const uint8_t* b = back.data_ptr<uint8_t>();
  size_t mismatches = 0;
  for (size_t i = 0; i < bytes; ++i) mismatches += b[i] != PatternByte(i);
  CHECK(mismatches == 0);
  CHECK(std::memcmp(b, map, bytes) == 0);

  std::printf("host_register: %zu MiB, register %.3f s/GiB, H2D %.1f GB/s\n", bytes >> 20,
              reg_s / (bytes / double(1 << 30)), reps * bytes / copy_s / 1e9);
  REQUIRE(cudaHostUnregister(map) == cudaSuccess);
  munmap(map, bytes);
  int status = owner.Finish();
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
}
