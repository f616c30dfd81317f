// A job as the coordinator keeps it: what clients see (JobSummary) plus what only the
// coordinator needs. This is also the row the journal stores.
#pragma once

#include <string>

#include "common/protocol/messages.h"

namespace lorastream::coordinator {

// The local user a request comes from (README: Trust model): the peer's uid on an ipc
// socket, the user a CURVE key maps to in authorized_clients, else the operator.
struct Submitter {
  int64_t uid = -1;  // -1: unknown
  std::string name;
};

// The user this process runs as (its effective uid).
Submitter CurrentSubmitter();

struct JobRecord {
  JobSummary summary;
  JobSpec spec;           // as validated at submission; what workers run
  std::string spec_toml;  // the text as written
  int32_t retries = 0;    // requeues after a worker died
  // The CURVE public key (Z85) of the client that submitted it; "" without CURVE. Under CURVE
  // only that key may cancel the job (Coordinator::Cancel).
  std::string owner;
};

}  // namespace lorastream::coordinator
