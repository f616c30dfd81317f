// The `lorastream` command: the coordinator daemon and the client verbs (submit, jobs, show,
// watch, stats, cancel, workers, keygen). Exit codes: 0 success; ExitCodeFor(code) for an
// Error (2 bad argument, 3 not found, 4 corrupt input, 5 refused — e.g. a job file with
// problems, 1 otherwise: unreachable coordinator, timeout); `watch` returns 1 when a watched
// job failed or was cancelled.
#pragma once

namespace lorastream::cli {

int RunLorastreamCli(int argc, char** argv);

}  // namespace lorastream::cli
