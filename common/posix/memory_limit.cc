#include "common/posix/memory_limit.h"

#include <unistd.h>

#include "common/base/format_bytes.h"

namespace lorastream {

uint64_t HostMemoryBytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<uint64_t>(pages) * static_cast<uint64_t>(page) : 0;
}

std::string MemoryLimitProblem(uint64_t estimate, uint64_t limit, const std::string& device) {
  if (limit == 0 || estimate <= limit) return "";
  return "the job's estimated peak memory, " + FormatBytes(estimate) + ", exceeds the " +
         FormatBytes(limit) + " of " + device +
         ": lower train.batch_size or data.seq_len (train.grad_accum keeps the tokens per "
         "step), or train a smaller model";
}

std::string GroupJoinProblem(const std::string& joiner, size_t members, uint64_t estimate,
                             uint64_t limit, const std::string& limit_what) {
  if (limit == 0 || estimate <= limit) return "";
  return "job " + joiner + " does not fit beside the group's " + std::to_string(members) +
         " job(s) under its plan: the group's estimated peak memory with it, " +
         FormatBytes(estimate) + ", exceeds " + limit_what + ", " + FormatBytes(limit);
}

}  // namespace lorastream
