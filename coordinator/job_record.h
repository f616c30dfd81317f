// A job as the coordinator keeps it: what clients see (JobSummary) plus what only the
// coordinator needs. This is also the row the journal stores.
#pragma once

#include <string>

#include "common/messages.h"

namespace lorastream {

struct JobRecord {
  JobSummary summary;
  JobSpec spec;           // as validated at submission; what workers run
  std::string spec_toml;  // the text as written
  int32_t retries = 0;  // requeues after a worker died
  // The CURVE public key (Z85) of the client that submitted it; "" without CURVE. Under CURVE
  // only that key may cancel the job (Coordinator::Cancel).
  std::string owner;
};

}  // namespace lorastream
