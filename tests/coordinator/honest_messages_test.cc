// The `lorastream` command says what happened, with the documented exit status: a coordinator
// that closes every connection is reported unreachable (not as a failed security handshake), a
// name too long to send is refused naming the limit, and the coordinator logs the journal
// errors it returns.
#include <catch2/catch.hpp>

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <thread>

#include "common/job/job_paths.h"
#include "common/job/job_spec.h"
#include "common/posix/unique_fd.h"
#include "tests/coordinator/cluster_fixture.h"

using namespace lorastream;
using namespace lorastream::testing;

namespace {

std::string ReadText(const fs::path& p) {
  std::ifstream in(p);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// A socket at `path` that accepts every connection and closes it at once: a coordinator going
// away (stopping, restarting) while a client connects.
class ClosingListener {
 public:
  explicit ClosingListener(const std::string& path) {
    fd_ = UniqueFd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    REQUIRE(fd_.valid());
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    REQUIRE(path.size() < sizeof(addr.sun_path));
    std::memcpy(addr.sun_path, path.c_str(), path.size());
    REQUIRE(::bind(fd_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
    REQUIRE(::listen(fd_.get(), 16) == 0);
    thread_ = std::thread([this] {
      while (!stop_) {
        pollfd p{fd_.get(), POLLIN, 0};
        if (::poll(&p, 1, 50) == 1) {
          const int conn = ::accept4(fd_.get(), nullptr, nullptr, SOCK_CLOEXEC);
          if (conn >= 0) {
            ++accepted_;
            ::close(conn);
          }
        }
      }
    });
  }
  ~ClosingListener() {
    stop_ = true;
    thread_.join();
  }
  int accepted() const { return accepted_; }

 private:
  UniqueFd fd_;
  std::atomic<bool> stop_{false};
  std::atomic<int> accepted_{0};
  std::thread thread_;
};

}  // namespace

TEST_CASE("a cancel that cannot reach the coordinator says so, not a CURVE failure",
          "[coordinator][cluster]") {
  Cluster c("unreachable");
  ClosingListener listener((c.dir() / "coordinator.sock").string());
  int code = -1;
  c.Cli({"--timeout", "2", "cancel", "1"}, &code, 30);
  const std::string err = ReadText(c.dir() / "cli.stderr");
  INFO(err);
  CHECK(listener.accepted() > 0);
  CHECK(code == 1);
  CHECK_THAT(err, Catch::Contains("cannot reach the coordinator at " + c.endpoint() +
                                  " within 2000 ms: it closed each connection before answering "
                                  "(it is stopping or restarting"));
  CHECK_THAT(err, !Catch::Contains("security handshake"));
}

TEST_CASE("a job name of 10 MB is refused at submit, naming the limit", "[coordinator][cluster]") {
  Cluster c("longname");
  c.StartCoordinator();
  const std::string job = c.WriteJob("x", 5);
  {  // The name is the file's first key: replace it.
    std::string text = ReadText(job);
    text.replace(0, text.find('\n'), "name = \"" + std::string(10'000'000, 'n') + "\"");
    std::ofstream(job, std::ios::trunc) << text;
  }
  int code = -1;
  c.Cli({"submit", job}, &code);
  const std::string err = ReadText(c.dir() / "cli.stderr");
  INFO(err.substr(0, 2000));
  CHECK(code == 5);
  CHECK_THAT(err, Catch::Contains("key `name` is 10000000 bytes long, above the limit of " +
                                  std::to_string(kMaxJobNameBytes) + " bytes"));
  CHECK_THAT(err, !Catch::Contains("protocol error"));
  CHECK(err.size() < 4096);  // the name itself is not echoed back

  // A client that sends one anyway is refused by the coordinator, with the same words.
  SubmitRequest req;
  req.spec = ParseJobSpec(ReadText(c.WriteJob("y", 5)), (c.dir() / "y.toml").string());
  ResolveJobSpecIn(req.spec, c.dir().string());
  req.spec.name = std::string(kMaxJobNameBytes + 1, 'n');
  const SubmitReply reply = c.NewClient().Call(req);
  REQUIRE(reply.problems.size() == 1);
  CHECK_THAT(reply.problems[0], Catch::Contains("above the limit of"));
}

TEST_CASE("the coordinator logs the journal write errors it returns", "[coordinator][cluster]") {
  Cluster c("journal-full");
  // A file size limit stands in for a full disk: the journal's writes fail past 256 KiB.
  const std::string db = (c.dir() / "journal.db").string();
  Subprocess coordinator =
      Subprocess::Spawn({"bash", "-c", "ulimit -f 256 && trap '' XFSZ && exec \"$0\" \"$@\"",
                         Bin("lorastream"), "coordinator", "--bind", c.endpoint(), "--db", db},
                        LogTo((c.dir() / "coordinator.log").string()));
  REQUIRE(WaitFor(
      [&] {
        try {
          c.NewClient(500).Call(ListJobsRequest{});
          return true;
        } catch (const Error&) {
          return false;
        }
      },
      30));
  // Job files of 64 KiB (a long comment), each its own output folder: a few fill the journal.
  int code = 0;
  for (int i = 0; i < 40 && code == 0; ++i) {
    const std::string job = c.WriteJob("big" + std::to_string(i), 5);
    std::ofstream(job, std::ios::app) << "# " << std::string(64 << 10, 'x') << "\n";
    c.Cli({"submit", "-q", job}, &code);
  }
  const std::string err = ReadText(c.dir() / "cli.stderr");
  INFO(err);
  CHECK(code == 1);
  CHECK_THAT(err, Catch::Contains("journal " + db));
  REQUIRE(WaitFor(
      [&] {
        return ReadText(c.dir() / "coordinator.log").find("request failed") != std::string::npos;
      },
      10));
  const std::string log = ReadText(c.dir() / "coordinator.log");
  INFO(log);
  CHECK_THAT(log, Catch::Contains("request failed: journal " + db));
  coordinator.Stop(5);
}
