// The load's progress reporter: its arithmetic, its throttling on a terminal and in a log
// (on a fake clock: no test sleeps), its thread safety, and the phases a real load reports.
#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "store/progress.h"
#include "store/server.h"
#include "test_util.h"

using namespace lorastream;
using namespace lorastream::store;
using namespace lorastream::testing;

namespace {

using TimePoint = std::chrono::steady_clock::time_point;

// Every line the reporter writes, in order: kind 'r' (terminal rewrite) or 'l' (log line).
class RecordingOutput : public ProgressOutput {
 public:
  struct Line {
    char kind;
    std::string text;
  };
  void Rewrite(std::string_view line) override { Add('r', line); }
  void Log(std::string_view line) override { Add('l', line); }
  std::vector<Line> lines() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return lines_;
  }
  std::vector<Line> Kind(char kind) const {
    std::vector<Line> out;
    for (const Line& l : lines())
      if (l.kind == kind) out.push_back(l);
    return out;
  }

 private:
  void Add(char kind, std::string_view line) {
    std::lock_guard<std::mutex> lock(mutex_);
    lines_.push_back({kind, std::string(line)});
  }
  mutable std::mutex mutex_;
  std::vector<Line> lines_;
};

// A clock the test moves by hand, in whole milliseconds (exact arithmetic).
struct FakeClock {
  TimePoint now{};
  void SetMs(int64_t ms) { now = TimePoint(std::chrono::milliseconds(ms)); }
  Progress::Clock Fn() {
    return [this] { return now; };
  }
};

}  // namespace

TEST_CASE("progress lines: bytes, percent, rate and time left", "[store]") {
  CHECK(DescribeProgress("reading", 5'200'000'000, 14'000'000'000, 2.0) ==
        "reading: 5.20 / 14.00 GB (37%), 2.60 GB/s, 3.4 s left");
  CHECK(DescribeProgress("quantising to nf4", 14'000'000'000, 14'000'000'000, 2.0) ==
        "quantising to nf4: 14.00 / 14.00 GB (100%), 7.00 GB/s");
  // Below a gigabyte in MB; before the first byte no rate and no time left.
  CHECK(DescribeProgress("checking weights", 0, 436'000'000, 0.5) ==
        "checking weights: 0.00 / 436.00 MB (0%), time left unknown");
  CHECK(DescribeProgress("x", 999, 1000, 1.0) == "x: 0.00 / 0.00 MB (99%), 0.00 GB/s, 0.0 s left");
  CHECK(FormatDuration(12.34) == "12.3 s");
  CHECK(FormatDuration(245) == "4 min 05 s");
  CHECK(FormatDuration(3720) == "1 h 02 min");
  // 140 GB at 0.5 GB/s after 40 GB: 200 s left.
  CHECK(DescribeProgress("reading", 40'000'000'000, 140'000'000'000, 80) ==
        "reading: 40.00 / 140.00 GB (28%), 0.50 GB/s, 3 min 20 s left");
}

TEST_CASE("progress on a terminal: one line rewritten a few times a second, none at first",
          "[store]") {
  RecordingOutput out;
  FakeClock clock;
  ProgressOptions options;
  options.terminal = true;
  Progress progress(out, options, clock.Fn());
  progress.BeginPhase("reading", 10'000'000'000);
  // 1 GB/s, ticked every 10 ms for 10 s.
  for (int ms = 10; ms <= 10000; ms += 10) {
    clock.SetMs(ms);
    progress.Add(10'000'000);
    progress.Tick();
  }
  const auto lines = out.lines();
  REQUIRE_FALSE(lines.empty());
  for (const auto& l : lines) CHECK(l.kind == 'r');  // a terminal gets no log line
  // Nothing in the first second; then at most one rewrite per 0.2 s.
  CHECK(lines.front().text == "reading: 1.00 / 10.00 GB (10%), 1.00 GB/s, 9.0 s left");
  CHECK(lines.size() == 46);  // at 1.0, 1.2, ..., 10.0 s
  CHECK(lines[1].text == "reading: 1.20 / 10.00 GB (12%), 1.00 GB/s, 8.8 s left");
  const PhaseTiming reading = progress.EndPhase();
  CHECK(reading.name == "reading");
  CHECK(reading.done == reading.total);
  CHECK(reading.seconds == Approx(10.0));

  // A new phase shows at once (the line names it), then is throttled again.
  progress.BeginPhase("quantising to fp8", 999'000'000);
  progress.Add(1000);
  progress.Tick();
  progress.Tick();
  CHECK(out.lines().size() == 47);
  CHECK(out.lines().back().text.rfind("quantising to fp8: 0.00 / 999.00 MB", 0) == 0);
  // Another log line clears the terminal's line; the next tick draws it again.
  bool logged = false;
  progress.Aside([&] { logged = true; });
  CHECK(logged);
  CHECK(out.lines().back().text.empty());
  progress.Tick();
  CHECK(out.lines().back().text.rfind("quantising to fp8", 0) == 0);
  progress.EndPhase();
  progress.Finish("loaded 11.00 GB");
  const auto end = out.lines();
  REQUIRE(end.size() >= 2);
  CHECK(end[end.size() - 2].kind == 'r');  // the line cleared...
  CHECK(end[end.size() - 2].text.empty());
  CHECK(end.back().kind == 'l');  // ...before the summary
  CHECK(end.back().text == "loaded 11.00 GB");
  CHECK(progress.phases().size() == 2);
}

TEST_CASE("progress in a log: a line per 5 s and 10% of the phase, whichever is rarer", "[store]") {
  RecordingOutput out;
  FakeClock clock;
  Progress progress(out, ProgressOptions{}, clock.Fn());
  int64_t ms = 0;
  auto run = [&](const std::string& name, uint64_t total, double gb_per_s) {
    progress.BeginPhase(name, total);
    const uint64_t step = static_cast<uint64_t>(gb_per_s * 1e9 / 100);  // per 10 ms
    for (uint64_t done = 0; done < total;) {
      const uint64_t add = std::min(step, total - done);
      done += add;
      ms += 10;
      clock.SetMs(ms);
      progress.Add(add);
      progress.Tick();
    }
    return progress.EndPhase();
  };
  SECTION("a small base: no progress line, only the summary") {
    run("checking weights", 100'000'000, 1.0);  // 0.1 s
    run("reading", 200'000'000, 2.0);           // 0.1 s
    CHECK(out.lines().empty());
    progress.Finish("loaded 0.20 GB in 0.20 s");
    REQUIRE(out.lines().size() == 1);
    CHECK(out.lines()[0].kind == 'l');
  }
  SECTION("a fast phase: every 5 s") {
    run("reading", 20'000'000'000, 1.0);  // 20 s: lines at 5, 10, 15 and 20 s
    const auto lines = out.Kind('l');
    REQUIRE(lines.size() == 4);
    CHECK(lines[0].text == "reading: 5.00 / 20.00 GB (25%), 1.00 GB/s, 15.0 s left");
    CHECK(lines[3].text == "reading: 20.00 / 20.00 GB (100%), 1.00 GB/s");
    CHECK(out.Kind('r').empty());  // a log gets no terminal line
  }
  SECTION("a slow phase: every 10%") {
    run("quantising to nf4", 10'000'000'000, 0.1);  // 100 s: a line per 10 s, the last at 100%
    const auto lines = out.Kind('l');
    REQUIRE(lines.size() == 10);
    CHECK(lines[0].text == "quantising to nf4: 1.00 / 10.00 GB (10%), 0.10 GB/s, 1 min 30 s left");
    CHECK(lines[9].text.find("(100%)") != std::string::npos);
  }
}

TEST_CASE("progress: every thread's bytes count, with a ticker printing beside them", "[store]") {
  RecordingOutput out;
  ProgressOptions options;
  options.terminal = true;
  options.quiet_seconds = 0;
  options.terminal_period = 0;
  Progress progress(out, options);
  constexpr int kThreads = 4, kAdds = 20000;
  progress.BeginPhase("reading", uint64_t{kThreads} * kAdds * 4096);
  {
    ProgressTicker ticker(progress, std::chrono::milliseconds(1));
    std::vector<std::thread> threads;
    for (int i = 0; i < kThreads; ++i)
      threads.emplace_back([&] {
        for (int k = 0; k < kAdds; ++k) progress.Add(4096);
      });
    for (std::thread& t : threads) t.join();
  }
  const PhaseTiming timing = progress.EndPhase();
  CHECK(timing.done == timing.total);
  REQUIRE_FALSE(out.lines().empty());
  CHECK(out.lines().back().text.find("(100%)") != std::string::npos);  // EndPhase's last tick
}

TEST_CASE("a store's load reports each phase with all of its bytes", "[store]") {
  TempDir dir("progress");
  Synth("tiny-qwen2", dir.str(), 3, "bf16");
  for (QuantMethod method : {QuantMethod::kNone, QuantMethod::kFp8, QuantMethod::kNf4}) {
    INFO(QuantMethodName(method));
    RecordingOutput out;
    // Each reading of the clock is 10 s after the last: every phase is long enough to log.
    std::atomic<int64_t> ticks{0};
    Progress progress(out, ProgressOptions{},
                      [&] { return TimePoint(std::chrono::seconds(10 * ticks.fetch_add(1))); });
    ServeOptions o;
    o.model_dir = dir.str();
    o.name = UniqueName("progress");
    o.threads = 2;
    o.quantize = method;
    auto store = PublishedStore::Build(o, {}, &progress);
    const std::vector<PhaseTiming> phases = progress.phases();
    std::vector<std::string> names;
    for (const PhaseTiming& p : phases) {
      names.push_back(p.name);
      CHECK(p.done == p.total);
      CHECK(p.total > 0);
    }
    std::vector<std::string> expected = {"checking weights", "allocating", "reading"};
    if (method != QuantMethod::kNone)
      expected.insert(expected.begin() + 2,
                      std::string("quantising to ") + QuantMethodName(method));
    CHECK(names == expected);
    // The bytes the phases counted are the load's.
    const LoadReport& r = store->report();
    CHECK(phases.back().total == r.bytes);
    CHECK(phases.front().total == r.source_bytes);
    if (method != QuantMethod::kNone) CHECK(phases[2].total == r.quantized_source_bytes);
    // In a log, each phase ended with its line at 100%.
    const auto lines = out.Kind('l');
    REQUIRE(lines.size() == expected.size());
    for (size_t i = 0; i < lines.size(); ++i) {
      CHECK(lines[i].text.rfind(expected[i] + ": ", 0) == 0);
      CHECK(lines[i].text.find("(100%)") != std::string::npos);
    }
    // The summary: every phase's time, and quantising's against the reading's.
    const std::string summary = DescribeLoad(r, method);
    CHECK(summary.rfind("loaded ", 0) == 0);
    CHECK_THAT(summary, Catch::Contains("checking weights") && Catch::Contains("reading"));
    if (method == QuantMethod::kNone) {
      CHECK_THAT(summary, !Catch::Contains("quantising"));
    } else {
      CHECK_THAT(summary, Catch::Contains("quantising 21 weights") &&
                              Catch::Contains(std::string("to ") + QuantMethodName(method)) &&
                              Catch::Contains("x the reading's time"));
    }
  }
}
