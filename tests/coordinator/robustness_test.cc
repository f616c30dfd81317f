// A live daemon against hostile input, and the trust rules: 10,000 random and mutated
// messages are each answered and leave it serving; CURVE refuses unauthenticated clients; a
// non-loopback bind needs keys.
#include <catch2/catch.hpp>

#include <random>
#include <zmq.hpp>

#include "tests/coordinator/cluster_fixture.h"

using namespace lorastream;
using namespace lorastream::client;
using namespace lorastream::testing;

namespace {

std::vector<std::string> ValidFrames(const Cluster& c) {
  std::vector<std::string> frames;
  frames.push_back(EncodeMessage(ListJobsRequest{true}, 1));
  frames.push_back(EncodeMessage(ShowJobRequest{1}, 2));
  frames.push_back(EncodeMessage(StatsRequest{1}, 3));
  frames.push_back(EncodeMessage(CancelRequest{2}, 4));
  frames.push_back(EncodeMessage(ListWorkersRequest{true}, 5));
  frames.push_back(EncodeMessage(HeartbeatRequest{"w-x", {{1, 1}}, 0}, 6));
  RegisterRequest reg;
  reg.host = "fuzzhost";
  reg.device = "cpu";
  reg.stores = {{"tiny", "fp"}};
  frames.push_back(EncodeMessage(reg, 7));
  StepReport step;
  step.worker_id = "w-x";
  step.job_id = 1;
  step.attempt = 1;
  frames.push_back(EncodeMessage(step, 8));
  SubmitRequest sub;
  sub.spec.name = "fuzz";
  sub.spec.model.store = "tiny";
  sub.spec.data.path = (c.dir() / "data.jsonl").string();
  sub.spec.data.format = "jsonl";
  sub.spec.train.steps = 3;
  sub.spec.train.output_dir = (c.dir() / "fuzz-out").string();
  sub.spec_toml = "name = \"fuzz\"";
  frames.push_back(EncodeMessage(sub, 9));
  frames.push_back(EncodeMessage(JobFinished{"w-x", 1, 1, JobOutcome::kFailed, "r", "", 0}, 10));
  return frames;
}

std::string Mutate(std::string f, std::mt19937& rng) {
  switch (rng() % 8) {
    case 0: {  // pure garbage
      std::string g(rng() % 300, '\0');
      for (char& ch : g) ch = static_cast<char>(rng());
      return g;
    }
    case 1:  // truncated
      f.resize(rng() % f.size());
      return f;
    case 2:  // another protocol version
      f[4] = static_cast<char>(2 + rng() % 200);
      return f;
    case 3:  // unknown or wrong type
      f[6] = static_cast<char>(rng());
      return f;
    case 4: {  // size field lies
      uint32_t size = static_cast<uint32_t>(rng());
      std::memcpy(&f[12], &size, 4);
      return f;
    }
    case 5:  // trailing bytes
      return f + std::string(1 + rng() % 16, 'x');
    default: {  // bit flips in the payload
      int flips = 1 + rng() % 6;
      for (int i = 0; i < flips; ++i) f[rng() % f.size()] ^= static_cast<char>(1 << (rng() % 8));
      return f;
    }
  }
}

}  // namespace

TEST_CASE(
    "10,000 random and mutated messages against a live daemon: all answered, still "
    "serving",
    "[coordinator][cluster]") {
  Cluster c("fuzz");
  c.StartCoordinator();
  std::mt19937 rng(20261129);
  std::vector<std::string> valid = ValidFrames(c);
  zmq::context_t ctx;
  zmq::socket_t dealer(ctx, zmq::socket_type::dealer);
  dealer.set(zmq::sockopt::linger, 0);
  dealer.connect(c.endpoint());
  int answered = 0, errors = 0;
  const int kMessages = 10000;
  for (int i = 0; i < kMessages; ++i) {
    std::string frame = Mutate(valid[rng() % valid.size()], rng);
    if (i % 500 == 7) {
      // Several frames in one message.
      dealer.send(zmq::buffer(frame), zmq::send_flags::sndmore);
      dealer.send(zmq::buffer(frame), zmq::send_flags::none);
    } else {
      dealer.send(zmq::buffer(frame), zmq::send_flags::none);
    }
    zmq::pollitem_t item{dealer.handle(), 0, ZMQ_POLLIN, 0};
    zmq::poll(&item, 1, std::chrono::milliseconds(5000));
    zmq::message_t reply;
    if (!(item.revents & ZMQ_POLLIN) || !dealer.recv(reply)) {
      FAIL("no reply to message " << i);
    }
    ++answered;
    Envelope env = DecodeEnvelope(reply.data(), reply.size());
    if (env.header.type == static_cast<uint16_t>(MessageType::kError)) ++errors;
  }
  CHECK(answered == kMessages);
  CHECK(errors > kMessages / 2);
  // Oversized (above the 16 MiB cap but below the transport cap): answered with kProtocol.
  std::string big = EncodeMessage(ListJobsRequest{}, 77);
  uint32_t size = kMaxPayloadBytes + 100;
  std::memcpy(&big[12], &size, 4);
  big.resize(kEnvelopeHeaderBytes + size, 'x');
  Client client = c.NewClient();
  try {
    client.Exchange(big, 77);
    std::string reply = client.Exchange(big, 77);
    Envelope env = DecodeEnvelope(reply.data(), reply.size());
    ErrorReply e = DecodeMessage<ErrorReply>(env);
    CHECK(e.code == ErrorCode::kProtocol);
    CHECK_THAT(e.message, Catch::Contains("oversized"));
  } catch (const Error& e) {
    FAIL(e.what());
  }
  // Still serving, and still the same process.
  CHECK(c.coordinator().Running());
  CHECK_NOTHROW(client.Call(ListJobsRequest{}));
  CHECK_THAT(c.Log("coordinator"), Catch::Contains("bad message"));
}

TEST_CASE("CURVE: an unauthenticated client is refused; keys are required off loopback",
          "[coordinator][cluster]") {
  Cluster c("curve");
  std::string keys = (c.dir() / "keys").string(), other = (c.dir() / "other").string();
  int code = -1;
  c.Cli({"keygen", "--out", keys}, &code);
  REQUIRE(code == 0);
  c.Cli({"keygen", "--out", keys}, &code);
  CHECK(code == 2);  // refuses to overwrite without --force
  c.Cli({"keygen", "--out", other}, &code);
  REQUIRE(code == 0);
  CHECK((fs::status(fs::path(keys) / "client.key").permissions() & fs::perms::group_read) ==
        fs::perms::none);
  // `other` holds an unauthorized client key but the right coordinator key.
  fs::copy_file(fs::path(keys) / "coordinator.pub", fs::path(other) / "coordinator.pub",
                fs::copy_options::overwrite_existing);

  c.StartCoordinator({"--curve-keys", keys}, keys);

  // Authenticated: works, through the command too.
  Client good = c.NewClient(3000, keys);
  CHECK_NOTHROW(good.Call(ListJobsRequest{}));
  std::string out = c.Cli({"--curve-keys", keys, "jobs"}, &code);
  CHECK(code == 0);

  // No CURVE at all: the handshake fails; no request is ever answered.
  Client plain = c.NewClient(2000);
  try {
    plain.Call(ListJobsRequest{});
    FAIL("a plain client was answered by a CURVE coordinator");
  } catch (const Error& e) {
    INFO(e.what());
    CHECK((e.code() == ErrorCode::kRefused || e.code() == ErrorCode::kTimeout));
  }
  c.Cli({"--timeout", "2", "jobs"}, &code);
  CHECK(code != 0);

  // CURVE with a key the coordinator does not list: refused by ZAP, said so.
  Client stranger = c.NewClient(3000, other);
  try {
    stranger.Call(ListJobsRequest{});
    FAIL("an unauthorized key was answered");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kRefused);
    CHECK_THAT(e.what(), Catch::Contains("refused"));
  }
  CHECK_THAT(c.Log("coordinator"), Catch::Contains("not authorized"));
  CHECK(c.coordinator().Running());

  // A non-loopback bind without keys is refused at start, naming the fix.
  std::string err_path = (c.dir() / "bind.stderr").string();
  RunAndCapture({Bin("lorastream"), "coordinator", "--bind", "tcp://0.0.0.0:0", "--db",
                 (c.dir() / "x.db").string()},
                &code, 20, err_path);
  CHECK(code == 2);
  std::ifstream err(err_path);
  std::string text((std::istreambuf_iterator<char>(err)), std::istreambuf_iterator<char>());
  CHECK_THAT(text, Catch::Contains("--curve-keys"));
}

TEST_CASE("CURVE: only the key that submitted a job can cancel it", "[coordinator][cluster]") {
  Cluster c("owner");
  const fs::path keys = c.dir() / "keys", second = c.dir() / "second";
  int code = -1;
  c.Cli({"keygen", "--out", keys.string()}, &code);
  REQUIRE(code == 0);
  c.Cli({"keygen", "--out", second.string()}, &code);
  REQUIRE(code == 0);
  // A second user: its own client key pair, admitted by the coordinator.
  fs::copy_file(keys / "coordinator.pub", second / "coordinator.pub",
                fs::copy_options::overwrite_existing);
  std::ifstream pub(second / "client.pub");
  std::string second_key;
  std::getline(pub, second_key);
  REQUIRE(second_key.size() == 40);
  std::ofstream(keys / "authorized_clients", std::ios::app) << second_key << "\n";
  c.StartCoordinator({"--curve-keys", keys.string()}, keys.string());

  std::string out =
      c.Cli({"--curve-keys", keys.string(), "submit", "-q", c.WriteJob("mine", 5)}, &code);
  REQUIRE(code == 0);
  const std::string id = out.substr(0, out.find_first_of(" \n"));
  out = c.Cli({"--curve-keys", second.string(), "cancel", id}, &code);
  CHECK(code == 5);                           // refused
  std::ifstream err(c.dir() / "cli.stderr");  // the command's stderr
  std::string errors((std::istreambuf_iterator<char>(err)), std::istreambuf_iterator<char>());
  CHECK_THAT(errors, Catch::Contains("another client key"));
  out = c.Cli({"--curve-keys", second.string(), "show", id}, &code);
  CHECK(code == 0);
  CHECK_THAT(out, Catch::Contains("queued"));  // nobody cancelled it
  out = c.Cli({"--curve-keys", keys.string(), "cancel", id}, &code);
  CHECK(code == 0);
  CHECK_THAT(out, Catch::Contains("cancel"));
}
