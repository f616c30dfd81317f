#include "tests/e2e/e2e_jobs.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <random>
#include <sstream>

#include <catch2/catch.hpp>

#include "common/formats/safetensors.h"
#include "common/posix/shm_names.h"
#include "common/posix/subprocess.h"
#include "coordinator/cli/local_cluster.h"
#include "store/attach.h"
#include "store/process.h"
#include "tests/support/test_support.h"

namespace lorastream::testing {

std::string WriteData(const std::string& dir, int documents, uint32_t seed) {
  std::string path = dir + "/data-" + std::to_string(seed) + ".jsonl";
  std::ofstream out(path);
  std::mt19937 rng(seed);
  for (int d = 0; d < documents; ++d) {
    out << "{\"input_ids\": [";
    int n = 20 + static_cast<int>(rng() % 60);
    for (int i = 0; i < n; ++i) out << (i ? ", " : "") << rng() % 512;
    out << "]}\n";
  }
  return path;
}

std::string WriteJob(const std::string& dir, const std::string& name, const std::string& store,
                     const std::string& data, int steps, int checkpoint_every, int seed,
                     const std::string& output_dir) {
  std::string path = dir + "/" + name + ".toml";
  std::ofstream out(path);
  out << "name = \"" << name << "\"\n"
      << "[model]\nstore = \"" << store << "\"\n"
      << "[data]\npath = \"" << data << "\"\nseq_len = 32\n"
      << "[lora]\nrank = 4\nalpha = 8.0\n"
      << "[optim]\nlr = 1e-3\n"
      << "[train]\nsteps = " << steps << "\nbatch_size = 2\nseed = " << seed
      << "\ncheckpoint_every = " << checkpoint_every << "\n";
  if (!output_dir.empty()) out << "output_dir = \"" << output_dir << "\"\n";
  return path;
}

void TrainStandalone(const std::string& job, const std::string& log) {
  int code = -1;
  RunAndCapture({Bin("lorastream-worker"), "train", job, "--device", "cpu"}, &code, 900, log);
  INFO("standalone training log: " << log);
  REQUIRE(code == 0);
}

void RequireSameAdapter(const std::string& a_dir, const std::string& b_dir) {
  SafetensorsFile a = SafetensorsFile::Open(a_dir + "/adapter_model.safetensors");
  SafetensorsFile b = SafetensorsFile::Open(b_dir + "/adapter_model.safetensors");
  REQUIRE(a.tensors().size() == b.tensors().size());
  REQUIRE(!a.tensors().empty());
  for (const auto& ta : a.tensors()) {
    const auto* tb = b.Find(ta.name);
    INFO(ta.name);
    REQUIRE(tb != nullptr);
    REQUIRE(ta.shape == tb->shape);
    REQUIRE(ta.nbytes() == tb->nbytes());
    CHECK(std::memcmp(a.Data(ta), b.Data(*tb), ta.nbytes()) == 0);
  }
}

int FreeLoopbackPort() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0);
  ::close(fd);
  return ntohs(addr.sin_port);
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

void WaitUntil(const std::function<bool()>& done, double timeout_s, const std::string& what) {
  INFO("waiting for " << what);
  REQUIRE(WaitFor(done, timeout_s, 100));
}

size_t WorkerRunningOnly(const cli::LocalCluster& cluster, int64_t id) {
  const nlohmann::json workers = nlohmann::json::parse(cluster.Client({"workers", "--json"}));
  for (const auto& w : workers)
    if (w.value("job_ids", std::vector<int64_t>{}) == std::vector<int64_t>{id})
      for (size_t i = 0; i < cluster.num_workers(); ++i)
        if (cluster.WorkerPid(i) == w.value("pid", 0)) return i;
  FAIL("no worker runs job " << id << " alone: " << workers.dump());
  return 0;
}

void CheckBaseHeldOnce(const cli::LocalCluster& cluster, const std::vector<int64_t>& ids,
                       double slack_kb) {
  WaitUntil(
      [&] {
        for (int64_t id : ids)
          if (cluster.ShowJob(id).value("step", 0) < 1) return false;
        return true;
      },
      600, "every job past its first step");
  const store::AttachedStore store = store::AttachedStore::Attach(cluster.store_name());
  const double base_kb = static_cast<double>(store.manifest().total_bytes()) / 1024.0;
  const std::string prefix = ShmPrefix(cluster.store_name());
  double pss_kb = store::ShmMappingUseOf(cluster.StorePid(), prefix).pss_bytes / 1024.0;
  for (size_t i = 0; i < cluster.num_workers(); ++i) {
    const store::ShmMappingUse w = store::ShmMappingUseOf(cluster.WorkerPid(i), prefix);
    INFO("worker " << i << " maps " << w.rss_bytes / 1024 << " KiB of the store's " << base_kb
                   << " KiB");
    CHECK(w.rss_bytes / 1024.0 >= 0.8 * base_kb);  // it really reads the shared copy
    pss_kb += w.pss_bytes / 1024.0;
  }
  // This process attached too (mapped, not touched: no resident pages of its own).
  INFO("total PSS " << pss_kb << " KiB for a base of " << base_kb << " KiB");
  CHECK(pss_kb <= 1.05 * base_kb + slack_kb);
  CHECK(pss_kb >= 0.9 * base_kb);
}

}  // namespace lorastream::testing
