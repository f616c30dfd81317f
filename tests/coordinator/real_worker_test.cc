// The coordinator with REAL workers (`lorastream-worker serve` training the tiny model from a
// `lorastream-store serve` store): a worker killed with SIGKILL mid-job, and the job finishes
// on the other worker, resuming from its checkpoint; then the coordinator killed and restarted
// mid-run, and the running job keeps its worker and finishes. Needs the worker build (LibTorch); in
// a build without it (-DLORASTREAM_WORKER=OFF) the binary is absent and the case says so.
#include <catch2/catch.hpp>

#include <csignal>
#include <random>

#include "tests/coordinator/cluster_fixture.h"

using namespace lorastream;
using namespace lorastream::client;
using namespace lorastream::testing;

TEST_CASE("cluster with real workers: SIGKILL a worker, then the coordinator, mid-job",
          "[coordinator][cluster][trainer]") {
  std::string worker_bin = std::string(LORASTREAM_BIN_DIR) + "/lorastream-worker";
  if (!fs::exists(worker_bin)) {
    WARN("lorastream-worker was not built (no LibTorch): skipped");
    return;
  }
  Cluster c("realworker");
  int code = -1;
  RunAndCapture({Bin("lorastream-synth"), "--preset", "tiny", "--out", (c.dir() / "tiny").string(),
                 "--presets-dir", std::string(LORASTREAM_SOURCE_DIR) + "/configs/models"},
                &code, 120, (c.dir() / "synth.log").string());
  REQUIRE(code == 0);
  std::string store = "coordtest" + std::to_string(getpid());
  Subprocess store_proc = Subprocess::Spawn(
      {Bin("lorastream-store"), "serve", (c.dir() / "tiny").string(), "--name", store},
      LogTo((c.dir() / "store.log").string()));
  {
    std::mt19937 rng(1);
    std::ofstream data(c.dir() / "tokens.jsonl");
    for (int doc = 0; doc < 64; ++doc) {
      data << "{\"input_ids\": [";
      for (int t = 0; t < 80; ++t) data << (t ? ", " : "") << rng() % 512;
      data << "]}\n";
    }
  }
  c.StartCoordinator();
  auto start_worker = [&](const std::string& name) {
    return Subprocess::Spawn({worker_bin, "serve", "--coordinator", c.endpoint(), "--device", "cpu",
                              "--store", store, "--threads", "1"},
                             LogTo((c.dir() / (name + ".log")).string()));
  };
  Subprocess a = start_worker("worker-a");
  Subprocess b = start_worker("worker-b");
  auto logs = [&] {
    return c.Log("coordinator") + c.Log("worker-a") + c.Log("worker-b") + c.Log("store");
  };
  if (!WaitFor([&] { return c.ListWorkersAlive() == 2; }, 120)) FAIL(logs());
  fs::path job = c.dir() / "job.toml";
  std::ofstream(job) << "name = \"real\"\n[model]\nstore = \"" << store << "\"\n[data]\npath = \""
                     << (c.dir() / "tokens.jsonl").string()
                     << "\"\nseq_len = 64\n[lora]\nrank = 4\n[train]\nsteps = 300\n"
                        "batch_size = 2\ncheckpoint_every = 10\noutput_dir = \""
                     << (c.dir() / "out-real").string() << "\"\n";
  int64_t id = c.Submit(job.string());
  if (!WaitFor([&] { return c.Job(id).step >= 25; }, 120)) FAIL(logs());
  // Kill whichever worker runs it.
  JobSummary before = c.Job(id);
  REQUIRE(before.state == JobState::kRunning);
  int32_t victim_pid = 0;
  Client client = c.NewClient();
  for (const WorkerSummary& w : client.Call(ListWorkersRequest{false}).workers)
    if (w.id == before.worker_id) victim_pid = w.pid;
  REQUIRE((victim_pid == a.pid() || victim_pid == b.pid()));
  Subprocess& victim = victim_pid == a.pid() ? a : b;
  Subprocess& survivor = victim_pid == a.pid() ? b : a;
  victim.Signal(SIGKILL);
  if (!c.WaitState(id, JobState::kSucceeded, 180)) FAIL(logs());
  JobSummary after = c.Job(id);
  CHECK(after.attempt == 2);
  CHECK(after.step == 300);
  CHECK(fs::exists(c.dir() / "out-real" / "adapter_model.safetensors"));
  CHECK(after.checkpoint_step >= 10);
  CHECK(after.worker_id != before.worker_id);

  // Then the coordinator is killed mid-run and restarted: the job is still there, its worker
  // re-registers with it (same attempt) and it finishes.
  std::ofstream(job) << "name = \"real2\"\n[model]\nstore = \"" << store << "\"\n[data]\npath = \""
                     << (c.dir() / "tokens.jsonl").string()
                     << "\"\nseq_len = 64\n[lora]\nrank = 4\n[train]\nsteps = 200\n"
                        "batch_size = 2\ncheckpoint_every = 10\noutput_dir = \""
                     << (c.dir() / "out-real2").string() << "\"\n";
  int64_t id2 = c.Submit(job.string());
  if (!WaitFor([&] { return c.Job(id2).step >= 20; }, 120)) FAIL(logs());
  c.coordinator().Signal(SIGKILL);
  c.coordinator().Wait(10);
  c.StartCoordinator();
  if (!c.WaitState(id2, JobState::kSucceeded, 180)) FAIL(logs());
  CHECK(c.Job(id2).attempt == 1);
  CHECK(c.Job(id).state == JobState::kSucceeded);
  CHECK(fs::exists(c.dir() / "out-real2" / "adapter_model.safetensors"));
  survivor.Stop(10);
  store_proc.Stop(10);
}
