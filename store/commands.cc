#include "store/commands.h"

#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <thread>

#include "common/base/error.h"
#include "common/base/finite_scan.h"
#include "common/base/format_bytes.h"
#include "store/attach.h"
#include "store/registry.h"

namespace lorastream::store {

void RunLs(std::ostream& out) {
  const std::vector<StoreListing> stores = ListStores();
  if (stores.empty()) {
    out << "no stores in /dev/shm\n";
    return;
  }
  for (const StoreListing& s : stores) {
    out << s.name << ": " << StoreStateName(s);
    if (s.record) out << ", owner pid " << s.record->owner_pid;
    // The largest unit in which the size is at least 1 ("12.50 MiB", not "0.012 GiB").
    out << ", " << s.objects.size() << " shm objects, " << FormatBytes(StoreBytes(s), 2);
    if (const std::string format = StoreFormat(s); !format.empty()) out << ", " << format;
    out << "\n";
    const std::vector<int64_t> attached = AttachedPids(s);
    out << "  attached processes (" << attached.size() << "):";
    for (int64_t pid : attached) out << " " << pid;
    out << "\n";
    if (!s.mapping_pids.empty()) {
      const uint64_t pss = StorePssBytes(s);
      const size_t n = s.mapping_pids.size();
      out << "  in RAM: " << FormatBytes(pss, 2) << " (" << pss << " bytes), the PSS summed over "
          << n << (n == 1 ? " process" : " processes") << " mapping it\n";
    }
    for (const ShmObject& o : s.objects) {
      char line[48];
      std::snprintf(line, sizeof(line), "  %14llu  ", static_cast<unsigned long long>(o.bytes));
      out << line << o.name << "\n";
    }
  }
}

void RunVerify(const std::string& name, int threads, std::ostream& out, bool hold) {
  if (threads <= 0) threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  const auto start = std::chrono::steady_clock::now();
  AttachedStore store = AttachedStore::Attach(name);
  VerifyChecksums(store, threads);  // throws naming every bad segment
  // Finite weights: serve refuses NaN/inf, but a store published before it did is caught here.
  const Manifest& manifest = store.manifest();
  auto scan = [&](const SegmentInfo& segment, const uint8_t* data, const std::string& prefix) {
    for (const TensorSlice& t : segment.tensors) {
      const int64_t bad = FirstNonFinite(data + t.offset, t.nbytes / DTypeSize(t.dtype), t.dtype);
      if (bad >= 0)
        throw Error(ErrorCode::kCorrupt, "store `" + name + "`: tensor `" + prefix + t.name +
                                             "` holds a NaN or infinite value (element " +
                                             std::to_string(bad) + ")");
    }
  };
  for (int i = 0; i < store.num_blocks(); ++i)
    scan(manifest.blocks[i], store.block_data(i), manifest.block_prefix(i));
  scan(manifest.rest, store.rest_data(), "");
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const Manifest& m = store.manifest();
  out << "store `" << name << "`: " << (m.is_diffusion() ? m.family() + ", " : "")
      << m.blocks.size() << (m.is_flux() ? " units + rest, " : " blocks + rest, ")
      << FormatBytes(m.total_bytes(), 2) << ", " << DTypeName(m.dtype) << m.DescribeCompression()
      << ", fingerprint " << m.fingerprint << ": every checksum matches (" << s << " s)\n";
  if (!hold) return;
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  out << "holding the store attached until SIGTERM or SIGINT" << std::endl;
  int sig = 0;
  sigwait(&signals, &sig);
}

}  // namespace lorastream::store
