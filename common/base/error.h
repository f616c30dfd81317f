// The one error type at every API boundary of lorastream.
//
// Choice (written down in the README's developer section): functions that can fail throw
// lorastream::Error, carrying a code and a message that names the file, field or message at
// fault. Executables catch it once in main() and map the code to an exit status; nothing
// crosses a ZeroMQ message as an exception (replies carry ErrorCode + message instead).
// Broken internal invariants use LS_CHECK, which throws Error with kInternal.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace lorastream {

enum class ErrorCode : int32_t {
  kOk = 0,
  kInvalidArgument = 1,  // bad command-line argument or API argument
  kNotFound = 2,         // a file, store, job or worker that does not exist
  kCorrupt = 3,          // malformed file or message (safetensors, TOML, envelope)
  kIo = 4,               // an OS call failed (open, mmap, read, write)
  kUnsupported = 5,      // valid input that this build or model type cannot handle
  kResource = 6,         // out of memory, shm too small, memlock limit
  kRefused = 7,          // a job that cannot run as specified (names the field and the fix)
  kProtocol = 8,         // wrong envelope version, unknown message type, oversized message
  kCancelled = 9,
  kTimeout = 10,
  kInternal = 11,  // a broken invariant: a bug in lorastream
};

const char* ErrorCodeName(ErrorCode code);

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message) : std::runtime_error(message), code_(code) {}
  ErrorCode code() const { return code_; }

 private:
  ErrorCode code_;
};

// Exit status of an executable for an error code, as the README documents: 0 ok (kOk), 2 bad
// argument, 3 not found, 4 corrupt input, 5 refused, 1 otherwise (kInternal included).
int ExitCodeFor(ErrorCode code);

[[noreturn]] void ThrowErrno(const std::string& what);  // kIo with strerror(errno)

// An exception's message without the backtrace LibTorch appends to it (c10::Error's what():
// the message, then "Exception raised from ..." and "frame #0: ..." lines): what a job's
// failure reason, a log line and a command's error show. Other messages come back as they are.
std::string WithoutBacktrace(const std::string& what);

}  // namespace lorastream

#define LS_CHECK(cond, msg)                                                                     \
  do {                                                                                          \
    if (!(cond))                                                                                \
      throw ::lorastream::Error(::lorastream::ErrorCode::kInternal,                             \
                                std::string("invariant failed: ") + #cond + " at " + __FILE__ + \
                                    ":" + std::to_string(__LINE__) + ": " + (msg));             \
  } while (0)
