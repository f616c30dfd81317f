#include "common/base/error.h"

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace lorastream {

std::string WithoutBacktrace(const std::string& what) {
  size_t cut = what.size();
  for (const char* marker : {"\nException raised from ", "\nframe #0", "\nframe #"}) {
    const size_t at = what.find(marker);
    if (at != std::string::npos) cut = std::min(cut, at);
  }
  std::string out = what.substr(0, cut);
  while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
  return out;
}

const char* ErrorCodeName(ErrorCode code) {
  switch (code) {
    case ErrorCode::kOk:
      return "ok";
    case ErrorCode::kInvalidArgument:
      return "invalid argument";
    case ErrorCode::kNotFound:
      return "not found";
    case ErrorCode::kCorrupt:
      return "corrupt";
    case ErrorCode::kIo:
      return "i/o error";
    case ErrorCode::kUnsupported:
      return "unsupported";
    case ErrorCode::kResource:
      return "resource exhausted";
    case ErrorCode::kRefused:
      return "refused";
    case ErrorCode::kProtocol:
      return "protocol error";
    case ErrorCode::kCancelled:
      return "cancelled";
    case ErrorCode::kTimeout:
      return "timeout";
    case ErrorCode::kInternal:
      return "internal error";
  }
  return "unknown error";
}

// (error.h's list, in full: a job file's value of the wrong type is kInvalidArgument, 2; what
// this build or model type cannot do, kUnsupported, is refused as kRefused is, 5.)
int ExitCodeFor(ErrorCode code) {
  switch (code) {
    case ErrorCode::kOk:
      return 0;
    case ErrorCode::kInvalidArgument:
      return 2;
    case ErrorCode::kNotFound:
      return 3;
    case ErrorCode::kCorrupt:
      return 4;
    case ErrorCode::kRefused:
    case ErrorCode::kUnsupported:  // refused as well: the same 5 from every command
      return 5;
    default:
      return 1;
  }
}

void ThrowErrno(const std::string& what) {
  int err = errno;
  throw Error(ErrorCode::kIo, what + ": " + std::strerror(err));
}

}  // namespace lorastream
