// Measurements for the closing note (hidden from CI: run with
// `coordinator_tests "[bench]"`): coordinator throughput for submit and status requests, and
// the latency from a worker's step report to a `watch` long poll seeing it.
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <thread>

#include "tests/coordinator/cluster_fixture.h"

using namespace lorastream;
using namespace lorastream::client;
using namespace lorastream::testing;

namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

SubmitRequest BenchJob(const Cluster& c, int i) {
  SubmitRequest r;
  r.spec.name = "bench-" + std::to_string(i);
  r.spec.source = "bench.toml";
  r.spec.model.store = "tiny";
  r.spec.data.path = (c.dir() / "data.jsonl").string();
  r.spec.data.format = "jsonl";
  r.spec.train.steps = 1000;
  r.spec.train.output_dir = (c.dir() / ("bench-out-" + std::to_string(i))).string();
  return r;
}

}  // namespace

TEST_CASE("bench: coordinator throughput and statistic-to-watch latency", "[.][bench]") {
  Cluster c("bench");
  c.StartCoordinator();
  const int kSubmits = 2000, kStatus = 20000, kClients = 4;

  // Submit: one client, sequential request/reply.
  Client client = c.NewClient();
  auto t0 = Clock::now();
  for (int i = 0; i < kSubmits; ++i) REQUIRE(client.Call(BenchJob(c, i)).job_id > 0);
  double submit_s = Seconds(t0);
  std::printf("submit: %d requests, 1 client: %.0f req/s (%.3f ms each)\n", kSubmits,
              kSubmits / submit_s, 1000 * submit_s / kSubmits);

  // Status (ShowJob), sequential and with concurrent clients.
  t0 = Clock::now();
  for (int i = 0; i < kStatus; ++i) client.Call(ShowJobRequest{1 + i % kSubmits});
  double show_s = Seconds(t0);
  std::printf("status (show): %d requests, 1 client: %.0f req/s\n", kStatus, kStatus / show_s);
  std::vector<std::thread> threads;
  t0 = Clock::now();
  for (int t = 0; t < kClients; ++t)
    threads.emplace_back([&, t] {
      Client mine = c.NewClient();
      for (int i = 0; i < kStatus / kClients; ++i)
        mine.Call(ShowJobRequest{1 + (i + t) % kSubmits});
    });
  for (auto& th : threads) th.join();
  double par_s = Seconds(t0);
  std::printf("status (show): %d requests, %d clients: %.0f req/s\n", kStatus, kClients,
              kStatus / par_s);
  threads.clear();
  t0 = Clock::now();
  for (int t = 0; t < kClients; ++t)
    threads.emplace_back([&, t] {
      Client mine = c.NewClient();
      for (int i = 0; i < kSubmits / kClients; ++i)
        mine.Call(BenchJob(c, kSubmits + t * kSubmits + i));
    });
  for (auto& th : threads) th.join();
  par_s = Seconds(t0);
  std::printf("submit: %d requests, %d clients: %.0f req/s\n", kSubmits, kClients,
              kSubmits / par_s);
  t0 = Clock::now();
  for (int i = 0; i < 50; ++i) client.Call(ListJobsRequest{true});
  std::printf("jobs (list of %d jobs): %.1f ms per request\n", 2 * kSubmits,
              1000 * Seconds(t0) / 50);

  // Latency: a protocol-level worker reports steps; a watcher long-polls as `watch` does.
  RegisterRequest reg;
  reg.host = "benchhost";
  reg.device = "cpu";
  reg.stores = {{"tiny", "fp"}};
  std::string wid = client.Call(reg).worker_id;
  HeartbeatReply hb = client.Call(HeartbeatRequest{wid, {}, 1});
  REQUIRE(hb.has_assignment);
  const int64_t job = hb.assignment.job_id;
  const int kReports = 300;
  std::vector<Clock::time_point> sent(kReports + 1);
  std::vector<double> latency_ms;
  std::atomic<int64_t> sent_step{0};
  std::thread watcher([&] {
    Client w = c.NewClient();
    WatchRequest req;
    req.job_ids = {job};
    req.wait_ms = 1000;
    int64_t seen = 0;
    while (seen < kReports) {
      WatchReply r = w.Call(req);
      req.since_version = r.version;
      int64_t step = r.jobs[0].step;
      auto now = Clock::now();
      if (step > seen && step <= sent_step.load()) {
        latency_ms.push_back(std::chrono::duration<double, std::milli>(now - sent[step]).count());
        seen = step;
      }
    }
  });
  for (int s = 1; s <= kReports; ++s) {
    StepReport rep;
    rep.worker_id = wid;
    rep.job_id = job;
    rep.attempt = hb.assignment.attempt;
    rep.stats.step = s;
    rep.stats.total_steps = 1000;
    sent[s] = Clock::now();
    sent_step = s;
    client.Call(rep);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  watcher.join();
  std::sort(latency_ms.begin(), latency_ms.end());
  std::printf("step report -> watch: %zu samples, median %.3f ms, p99 %.3f ms, max %.3f ms\n",
              latency_ms.size(), latency_ms[latency_ms.size() / 2],
              latency_ms[latency_ms.size() * 99 / 100], latency_ms.back());
  CHECK(latency_ms.size() >= kReports / 2);
}
