#include "store/server.h"

#include <signal.h>
#include <sys/resource.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <fstream>
#include <optional>
#include <random>
#include <thread>

#include <nlohmann/json.hpp>

#include "common/base/error.h"
#include "common/base/format_bytes.h"
#include "common/base/log.h"
#include "common/formats/safetensors.h"
#include "common/posix/shm_names.h"
#include "store/checksum.h"
#include "store/dit_pack.h"
#include "store/layout.h"
#include "store/loader.h"
#include "store/parallel.h"
#include "store/progress.h"
#include "store/registry.h"

namespace lorastream::store {

namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

uint64_t NewGeneration() {
  std::random_device rd;
  const uint64_t random = (uint64_t{rd()} << 32) ^ rd();
  const uint64_t now =
      static_cast<uint64_t>(std::chrono::system_clock::now().time_since_epoch().count());
  return Xxh64(&now, sizeof(now), random) ^ (static_cast<uint64_t>(::getpid()) << 48);
}

void CheckShmSpace(uint64_t needed) {
  struct statvfs vfs {};
  if (::statvfs(kShmDir, &vfs) != 0) return;  // no /dev/shm view: fallocate will tell
  const uint64_t free_bytes = uint64_t{vfs.f_bavail} * vfs.f_frsize;
  const uint64_t size = uint64_t{vfs.f_blocks} * vfs.f_frsize;
  if (needed > free_bytes)
    throw Error(ErrorCode::kResource,
                "the store needs " + FormatGiB(needed) + " of /dev/shm, which has " +
                    FormatGiB(free_bytes) + " free (of " + FormatGiB(size) +
                    "); free space there or enlarge it: mount -o remount,size=<N>G /dev/shm");
}

std::string ShmemThpSetting() {
  std::ifstream in("/sys/kernel/mm/transparent_hugepage/shmem_enabled");
  std::string line;
  std::getline(in, line);
  const size_t a = line.find('['), b = line.find(']');
  return a != std::string::npos && b > a ? line.substr(a + 1, b - a - 1) : "unknown";
}

}  // namespace

std::string ComputeFingerprint(const Manifest& m) {
  std::string text =
      ManifestShapeJson(m) + "|" + DTypeName(m.dtype) + "|" + std::to_string(m.alignment);
  auto add = [&](const SegmentInfo& s) {
    text += "|" + std::to_string(s.nbytes) + ":" + std::to_string(s.checksum);
    for (const TensorSlice& t : s.tensors) {
      text += ";" + t.name + "," + DTypeName(t.dtype) + "," + std::to_string(t.offset);
      if (t.quant.compressed()) text += "," + DescribeQuant(t.quant);
      for (int64_t d : t.shape) text += "x" + std::to_string(d);
    }
  };
  for (const SegmentInfo& b : m.blocks) add(b);
  add(m.rest);
  char buf[24];
  std::snprintf(buf, sizeof(buf), "%016" PRIx64, Xxh64(text.data(), text.size(), 0x6c6f7261));
  return buf;
}

std::string DescribeLoad(const LoadReport& r, QuantMethod quantize) {
  auto rate = [](uint64_t bytes, double seconds) {
    return seconds > 0 ? bytes / seconds / 1e9 : 0;
  };
  char buf[512];
  int n = std::snprintf(buf, sizeof buf,
                        "loaded %.2f GB in %.2f s (%.2f GB/s, %d threads): checking weights "
                        "%.2f s (%.2f GB/s), allocating %.2f s",
                        r.bytes / 1e9, r.total_seconds, rate(r.bytes, r.total_seconds), r.threads,
                        r.check_seconds, rate(r.source_bytes, r.check_seconds), r.prefault_seconds);
  std::string text(buf, static_cast<size_t>(n));
  if (r.quantized_weights > 0) {
    n = std::snprintf(
        buf, sizeof buf, ", quantising %zu weights (%.2f GB) to %s %.2f s (%.2f GB/s)",
        r.quantized_weights, r.quantized_source_bytes / 1e9, QuantMethodName(quantize),
        r.quantize_seconds, rate(r.quantized_source_bytes, r.quantize_seconds));
    text.append(buf, static_cast<size_t>(n));
  }
  n = std::snprintf(buf, sizeof buf, ", reading %.2f s (%.2f GB/s)", r.load_seconds,
                    rate(r.bytes, r.load_seconds));
  text.append(buf, static_cast<size_t>(n));
  if (r.quantized_weights > 0 && r.load_seconds > 0) {
    n = std::snprintf(buf, sizeof buf, "; quantising took %.2fx the reading's time",
                      r.quantize_seconds / r.load_seconds);
    text.append(buf, static_cast<size_t>(n));
  }
  return text;
}

std::unique_ptr<PublishedStore> PublishedStore::Build(const ServeOptions& options,
                                                      const std::function<bool()>& should_stop,
                                                      Progress* progress) {
  const auto start = Clock::now();
  ValidateStoreName(options.name);
  const int threads = options.threads > 0
                          ? options.threads
                          : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  // Everything that can be wrong with the checkpoint is found here, before any shm object.
  PackOptions pack;
  pack.to_bf16 = options.to_bf16;
  pack.scan_weights = false;  // below, after the checks that need no weight read
  pack.quantize = options.quantize;
  pack.quantize_head = options.quantize_head;
  pack.quantize_embedding = options.quantize_embedding;
  // A diffusion checkpoint (FLUX.1: a BFL file or a diffusers folder; Qwen-Image: ComfyUI's
  // single file or a diffusers folder) is packed per streaming unit.
  std::optional<Checkpoint> checkpoint;
  std::optional<DitPackPlan> dit;
  PackPlan llm;
  // Qwen-Image's names are asked for first: any other single file is taken for FLUX's (and
  // refused naming what FLUX.1 lacks).
  if (IsQwenImageCheckpointPath(options.model_dir)) {
    dit.emplace(PlanQwenImagePack(options.model_dir, pack));
  } else if (IsFluxCheckpointPath(options.model_dir)) {
    dit.emplace(PlanFluxPack(options.model_dir, pack));
  } else {
    checkpoint.emplace(Checkpoint::Open(options.model_dir));
    llm = PlanPack(*checkpoint, pack);
  }
  PackPlan& plan = dit ? dit->load : llm;
  uint64_t needed = 0;
  for (const SegmentInfo& b : plan.manifest.blocks) needed += RoundUpToPage(b.nbytes);
  needed += RoundUpToPage(plan.manifest.rest.nbytes);

  RemoveStaleStore(options.name);  // refuses when a live store holds the name
  CheckShmSpace(needed);
  const auto check_start = Clock::now();
  const uint64_t source_bytes = RefuseNonFiniteWeights(plan, progress, threads);
  std::unique_ptr<PublishedStore> store(new PublishedStore());
  store->report_.source_bytes = source_bytes;
  store->report_.check_seconds = Seconds(check_start);
  store->claim_ = std::make_unique<ManifestClaim>(ManifestClaim::Claim(options.name, options.mode));
  Manifest& m = plan.manifest;
  m.store_name = options.name;
  m.generation = NewGeneration();
  m.owner_pid = ::getpid();
  for (size_t i = 0; i < m.blocks.size(); ++i)
    m.blocks[i].shm_name = BlockShmName(options.name, m.generation, static_cast<int>(i));
  m.rest.shm_name = RestShmName(options.name, m.generation);

  // The load's other log lines go around the terminal's progress line.
  auto aside = [progress](const std::function<void()>& log) {
    if (progress)
      progress->Aside(log);
    else
      log();
  };
  const auto prefault_start = Clock::now();
  bool huge_refused = false, lock_refused = false;
  const size_t count = m.blocks.size() + 1;
  // Creating and prefaulting costs a page fault per 4 KiB page: done by all threads at once.
  store->segments_.resize(count);
  if (progress) progress->BeginPhase("allocating", needed);
  RunParallel(count, threads, [&](size_t i) {
    const SegmentInfo& info = i < m.blocks.size() ? m.blocks[i] : m.rest;
    store->segments_[i] =
        ShmSegment::Create(info.shm_name, info.nbytes, options.mode, options.huge_pages);
    if (progress) progress->Add(RoundUpToPage(info.nbytes));
  });
  if (progress) progress->EndPhase();
  for (ShmSegment& seg : store->segments_) {
    if (options.huge_pages && !seg.huge_pages_advised()) huge_refused = true;
    if (options.lock && !lock_refused && !seg.Lock()) {
      lock_refused = true;
      struct rlimit limit {};
      ::getrlimit(RLIMIT_MEMLOCK, &limit);
      aside([&] {
        LS_LOG_WARN(
            "cannot lock the store in RAM (memlock limit {} KiB, store {}): it stays unlocked "
            "and may be swapped. Fix: `ulimit -l unlimited` before starting, or "
            "LimitMEMLOCK=infinity in the systemd unit",
            limit.rlim_cur == RLIM_INFINITY ? -1 : static_cast<long long>(limit.rlim_cur / 1024),
            FormatGiB(needed));
      });
    }
  }
  const std::string thp = ShmemThpSetting();
  if (options.huge_pages &&
      (huge_refused || (thp != "always" && thp != "advise" && thp != "within_size")))
    aside([&] {
      LS_LOG_INFO(
          "shared memory is on 4 KiB pages: shmem transparent huge pages are `{}`; to "
          "enable: echo advise > /sys/kernel/mm/transparent_hugepage/shmem_enabled",
          thp);
    });
  store->report_.prefault_seconds = Seconds(prefault_start);

  std::vector<ShmSegment*> pointers;
  for (ShmSegment& s : store->segments_) pointers.push_back(&s);
  const LoadResult quantized = QuantizeSegments(plan, pointers, threads, should_stop, progress);
  LoadResult load = LoadSegments(plan, pointers, threads, should_stop, progress);
  for (ShmSegment& s : store->segments_) s.MakeReadOnly();  // never written after publishing
  if (dit) m = DitPublishedManifest(*dit);  // the layout's whole tensors, not the pieces

  m.fingerprint = ComputeFingerprint(m);
  m.owner_start_time = 0;  // filled from the claim's header below
  {
    auto record = ReadManifestObject(options.name);
    if (record) m.owner_start_time = record->owner_start_time;
  }
  store->claim_->Publish(m);
  store->manifest_ = m;
  store->report_.bytes = load.bytes;
  store->report_.load_seconds = load.seconds;
  store->report_.quantized_weights = plan.quantize.size();
  store->report_.quantized_source_bytes = quantized.bytes;
  store->report_.quantize_seconds = quantized.seconds;
  store->report_.threads = threads;
  store->report_.locked = options.lock && !lock_refused;
  store->report_.total_seconds = Seconds(start);
  return store;
}

PublishedStore::~PublishedStore() {
  segments_.clear();  // unlink the segments first, the manifest (claim_) last
  claim_.reset();
}

int RunServe(const ServeOptions& options) {
  // Signals are blocked in every thread and taken synchronously: the loader polls for them,
  // and the idle store sleeps in sigwait.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  auto signalled = [] {
    sigset_t pending;
    sigpending(&pending);
    return sigismember(&pending, SIGTERM) == 1 || sigismember(&pending, SIGINT) == 1;
  };
  StderrProgressOutput progress_output;
  ProgressOptions progress_options;
  progress_options.terminal = ::isatty(STDERR_FILENO) == 1;
  Progress progress(progress_output, progress_options);
  std::unique_ptr<PublishedStore> store;
  {
    ProgressTicker ticker(progress, std::chrono::milliseconds(100));
    store = PublishedStore::Build(options, signalled, &progress);
  }
  const Manifest& m = store->manifest();
  const LoadReport& r = store->report();
  progress.Finish(DescribeLoad(r, m.quant().method));
  LS_LOG_INFO("store `{}` published: {} {} + rest, {} {}{}, fingerprint {}, generation {:016x}, {}",
              m.store_name, m.blocks.size(),
              m.is_flux() ? "FLUX.1 units (" + std::to_string(m.flux_singles_per_unit) +
                                " single blocks per unit)"
              : m.is_qwen_image() ? std::string("Qwen-Image blocks")
                                  : std::string("blocks"),
              FormatGiB(r.bytes), DTypeName(m.dtype), m.DescribeCompression(), m.fingerprint,
              m.generation, r.locked ? "locked in RAM" : "not locked");
  std::printf(
      "published %s fingerprint=%s bytes=%llu load_s=%.4f load_gbps=%.3f prefault_s=%.4f "
      "quantize=%s quantize_s=%.4f check_s=%.4f total_s=%.4f\n",
      m.store_name.c_str(), m.fingerprint.c_str(), static_cast<unsigned long long>(r.bytes),
      r.load_seconds, r.bytes / r.load_seconds / 1e9, r.prefault_seconds,
      QuantMethodName(m.quant().method), r.quantize_seconds, r.check_seconds, r.total_seconds);
  std::fflush(stdout);
  int sig = 0;
  sigwait(&signals, &sig);
  LS_LOG_INFO(
      "store `{}`: {} received, unlinking its segments (attached workers keep their "
      "mappings)",
      m.store_name, sig == SIGTERM ? "SIGTERM" : "SIGINT");
  store.reset();
  return 0;
}

}  // namespace lorastream::store
