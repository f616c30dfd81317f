// The one main wrapper of every executable (lorastream, lorastream-store, lorastream-synth,
// lorastream-worker, lorastream-bench-stream, lorastream-memcpy-bench), so that exit statuses
// are the README's: 0 ok, 2 bad argument
// (command-line errors included), 3 not found, 4 corrupt input, 5 refused, 1 otherwise
// (internal errors included). Header-only: only mains, which link CLI11, include it.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>
#include <functional>
#include <new>

#include "common/base/build_version.h"
#include "common/base/error.h"

namespace lorastream {

// Runs `body`, reporting what escapes it on stderr as "PROGRAM: KIND: MESSAGE" and mapping it
// to an exit status (Error by ExitCodeFor, anything else 1).
inline int RunMainBody(const char* program, const std::function<int()>& body) {
  try {
    return body();
  } catch (const Error& e) {
    std::fprintf(stderr, "%s: %s: %s\n", program, ErrorCodeName(e.code()), e.what());
    return ExitCodeFor(e.code());
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "%s: out of memory\n", program);
    return ExitCodeFor(ErrorCode::kResource);
  } catch (const std::exception& e) {
    // LibTorch's errors carry a backtrace of dozens of frames: the message alone.
    std::fprintf(stderr, "%s: internal error: %s\n", program, WithoutBacktrace(e.what()).c_str());
    return ExitCodeFor(ErrorCode::kInternal);
  }
}

// Parses the command line into `app` (0 after --help or --version, 2 for a parse error, which
// CLI11 has printed with the usage), then runs `body` as RunMainBody does. Every executable
// answers --version (common/base/build_version.h).
inline int RunMain(const char* program, CLI::App& app, int argc, char** argv,
                   const std::function<int()>& body) {
  std::string version = VersionText(program);
  version.pop_back();  // CLI11 ends the line itself
  app.set_version_flag("--version", version, "print the version, commit, LibTorch and CUDA");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : ExitCodeFor(ErrorCode::kInvalidArgument);
  }
  return RunMainBody(program, body);
}

}  // namespace lorastream
