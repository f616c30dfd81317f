// The envelope and message codec: round trips of every message type, and each kind of
// malformed frame rejected with its own clear error (never a crash).
#include <catch2/catch.hpp>

#include <random>

#include "common/protocol/messages.h"

using namespace lorastream;

namespace {

template <class T>
T RoundTrip(const T& message, uint32_t id = 7) {
  std::string frame = EncodeMessage(message, id);
  Envelope env = DecodeEnvelope(frame.data(), frame.size());
  REQUIRE(env.header.request_id == id);
  REQUIRE(env.header.type == static_cast<uint16_t>(MessageTraits<T>::kType));
  return DecodeMessage<T>(env);
}

// The error code and message a frame decodes to (as a ListJobsReply), or kOk.
std::pair<ErrorCode, std::string> Failure(const std::string& frame) {
  try {
    Envelope env = DecodeEnvelope(frame.data(), frame.size());
    DecodeMessage<ListJobsReply>(env);
  } catch (const Error& e) {
    return {e.code(), e.what()};
  }
  return {ErrorCode::kOk, ""};
}

ListJobsReply SampleJobs() {
  ListJobsReply reply;
  JobSummary j;
  j.id = 42;
  j.name = "tiny-a";
  j.state = JobState::kRunning;
  j.worker_id = "w-1";
  j.has_stats = true;
  j.last_stats.step = 12;
  j.last_stats.loss = 2.5;
  j.last_stats.h2d_bytes = 1ull << 40;
  reply.jobs = {j, j};
  reply.jobs[1].state = JobState::kCancelled;
  reply.jobs[1].reason = "cancelled at step 3";
  return reply;
}

}  // namespace

TEST_CASE("every message type round-trips through the envelope", "[common][envelope]") {
  RegisterRequest reg;
  reg.host = "h";
  reg.device = "cuda:1";
  reg.gpu_name = "H200";
  reg.gpu_memory_bytes = 141ull << 30;
  reg.stores = {{"llama", "fp1"}, {"qwen", "fp2"}};
  reg.running = {{9, 2}, {11, 1}};
  reg.slots = 4;
  reg.uid = 0;
  RegisterRequest reg2 = RoundTrip(reg);
  CHECK(reg2.stores.size() == 2);
  CHECK(reg2.stores[1].fingerprint == "fp2");
  CHECK(reg2.gpu_memory_bytes == reg.gpu_memory_bytes);
  REQUIRE(reg2.running.size() == 2);
  CHECK(reg2.running[0].job_id == 9);
  CHECK(reg2.running[0].attempt == 2);
  CHECK(reg2.running[1].job_id == 11);
  CHECK(reg2.slots == 4);
  CHECK(reg2.uid == 0);

  HeartbeatReply hb;
  hb.has_assignment = true;
  hb.assignment.job_id = 3;
  hb.assignment.spec.name = "j";
  hb.assignment.spec.lora.targets = {"q_proj"};
  hb.assignment.spec.stream.gpu_memory_budget = 8ull << 30;
  hb.assignment.spec.stream.taped_blocks = -1;
  hb.assignment.spec.stream.budget_auto = true;
  HeartbeatReply hb2 = RoundTrip(hb);
  CHECK(hb2.has_assignment);
  CHECK(hb2.assignment.spec.lora.targets == std::vector<std::string>{"q_proj"});
  CHECK(hb2.assignment.spec.stream.gpu_memory_budget == (8ull << 30));
  CHECK(hb2.assignment.spec.stream.taped_blocks == -1);  // the coordinator passes it on
  CHECK(hb2.assignment.spec.stream.budget_auto);

  StepReport step;
  step.stats.step = 5;
  step.stats.tokens_per_second = 1234.5;
  CHECK(RoundTrip(step).stats.tokens_per_second == 1234.5);

  JobFinished done;
  done.outcome = JobOutcome::kInterrupted;
  done.reason = "shutdown";
  CHECK(RoundTrip(done).outcome == JobOutcome::kInterrupted);

  ListJobsReply jobs = RoundTrip(SampleJobs());
  REQUIRE(jobs.jobs.size() == 2);
  CHECK(jobs.jobs[1].state == JobState::kCancelled);
  CHECK(jobs.jobs[0].last_stats.h2d_bytes == (1ull << 40));

  ErrorReply err{ErrorCode::kRefused, "no"};
  CHECK(RoundTrip(err).code == ErrorCode::kRefused);
  CHECK(RoundTrip(WatchRequest{{1, 2}, 17, 250}).job_ids.size() == 2);
  CHECK(RoundTrip(ListWorkersRequest{false}).include_dead == false);
  CHECK(RoundTrip(CancelReply{JobState::kCancelled}).state == JobState::kCancelled);
}

TEST_CASE("malformed frames are distinct, clear errors", "[common][envelope]") {
  const std::string good = EncodeMessage(SampleJobs(), 1);
  REQUIRE(Failure(good).first == ErrorCode::kOk);

  SECTION("shorter than the header") {
    auto [code, msg] = Failure(good.substr(0, 10));
    CHECK(code == ErrorCode::kCorrupt);
    CHECK_THAT(msg, Catch::Contains("header alone needs 16"));
  }
  SECTION("foreign magic") {
    std::string f = good;
    f[0] = 'X';
    auto [code, msg] = Failure(f);
    CHECK(code == ErrorCode::kCorrupt);
    CHECK_THAT(msg, Catch::Contains("not a lorastream message"));
  }
  SECTION("another protocol version") {
    std::string f = good;
    f[4] = 1;  // a worker of the build before job slots
    auto [code, msg] = Failure(f);
    CHECK(code == ErrorCode::kProtocol);
    CHECK_THAT(msg, Catch::Contains("protocol version 1"));
  }
  SECTION("payload above the cap") {
    std::string f = good;
    uint32_t huge = kMaxPayloadBytes + 1;
    std::memcpy(&f[12], &huge, 4);
    auto [code, msg] = Failure(f);
    CHECK(code == ErrorCode::kProtocol);
    CHECK_THAT(msg, Catch::Contains("oversized"));
    CHECK_THROWS_AS(EncodeEnvelope(30, 1, std::string(kMaxPayloadBytes + 1, 'x')), Error);
  }
  SECTION("truncated payload") {
    auto [code, msg] = Failure(good.substr(0, good.size() - 3));
    CHECK(code == ErrorCode::kCorrupt);
    CHECK_THAT(msg, Catch::Contains("truncated"));
  }
  SECTION("payload consistent with the header but cut inside a field") {
    std::string payload = good.substr(kEnvelopeHeaderBytes, 30);
    auto [code, msg] = Failure(EncodeEnvelope(33, 1, payload));
    CHECK(code == ErrorCode::kCorrupt);
    CHECK_THAT(msg, Catch::Contains("ListJobsReply"));
  }
  SECTION("trailing bytes after the last field") {
    std::string payload = good.substr(kEnvelopeHeaderBytes) + "xx";
    auto [code, msg] = Failure(EncodeEnvelope(33, 1, payload));
    CHECK(code == ErrorCode::kCorrupt);
    CHECK_THAT(msg, Catch::Contains("unexpected bytes"));
  }
  SECTION("unknown message type") {
    std::string f = good;
    f[6] = 99;
    auto [code, msg] = Failure(f);
    CHECK(code == ErrorCode::kProtocol);
    CHECK_THAT(msg, Catch::Contains("unknown message type 99"));
  }
  SECTION("a known type that is not the expected one") {
    auto [code, msg] = Failure(EncodeMessage(CancelRequest{3}, 1));
    CHECK(code == ErrorCode::kProtocol);
    CHECK_THAT(msg, Catch::Contains("expected a ListJobsReply"));
  }
  SECTION("a list length larger than the payload") {
    std::string payload(8, '\0');
    uint64_t n = 1ull << 60;
    std::memcpy(&payload[0], &n, 8);
    auto [code, msg] = Failure(EncodeEnvelope(33, 1, payload));
    CHECK(code == ErrorCode::kCorrupt);
    CHECK_THAT(msg, Catch::Contains("exceeds"));
  }
  SECTION("an enum out of range") {
    ListJobsReply one;
    one.jobs.resize(1);
    std::string f = EncodeMessage(one, 1);
    // The state follows the 8-byte list count, the 8-byte id and the empty name's count.
    size_t state_at = kEnvelopeHeaderBytes + 8 + 8 + 8;
    f[state_at] = 9;
    auto [code, msg] = Failure(f);
    CHECK(code == ErrorCode::kCorrupt);
    CHECK_THAT(msg, Catch::Contains("enum value 9"));
  }
  SECTION("a bool that is neither 0 nor 1") {
    std::string f = EncodeMessage(ListJobsRequest{true}, 1);
    f[kEnvelopeHeaderBytes] = 7;
    Envelope env = DecodeEnvelope(f.data(), f.size());
    CHECK_THROWS_WITH(DecodeMessage<ListJobsRequest>(env), Catch::Contains("bool"));
  }
}

TEST_CASE("random mutations never crash the decoder", "[common][envelope]") {
  std::mt19937 rng(1234);
  const std::string good = EncodeMessage(SampleJobs(), 1);
  int rejected = 0;
  for (int i = 0; i < 20000; ++i) {
    std::string f = good;
    int flips = 1 + rng() % 4;
    for (int k = 0; k < flips; ++k) f[rng() % f.size()] = static_cast<char>(rng());
    if (rng() % 4 == 0) f.resize(rng() % f.size());
    if (Failure(f).first != ErrorCode::kOk) ++rejected;
  }
  CHECK(rejected > 1000);  // most mutations are caught; none crashed
  CHECK(PeekRequestId(good.data(), good.size()) == 1u);
  CHECK_FALSE(PeekRequestId("abc", 3).has_value());
}
