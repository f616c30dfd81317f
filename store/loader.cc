#include "store/loader.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <map>
#include <mutex>
#include <thread>

#include "common/base/error.h"
#include "common/posix/unique_fd.h"
#include "store/checksum.h"
#include "store/convert.h"
#include "store/progress.h"

namespace lorastream::store {

namespace {

// Copy-then-hash granularity: small enough to stay in L2, a multiple of kBulkHashBlock and
// of the 256-byte tensor alignment (so pieces split tensors on element boundaries).
constexpr uint64_t kPieceBytes = 256u << 10;
static_assert(kPieceBytes % kBulkHashBlock == 0 && kChecksumChunkBytes % kPieceBytes == 0);

struct Segment {
  SegmentInfo* info;
  const std::vector<Checkpoint::Ref>* sources;
  uint8_t* data;
  std::vector<uint64_t> chunk_hashes;
};

void PreadExact(int fd, uint8_t* out, size_t n, uint64_t offset, const std::string& path) {
  while (n > 0) {
    ssize_t r = ::pread(fd, out, n, static_cast<off_t>(offset));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) ThrowErrno(path + ": read failed");
    if (r == 0) throw Error(ErrorCode::kCorrupt, path + ": file shrank while loading");
    out += r;
    n -= static_cast<size_t>(r);
    offset += static_cast<uint64_t>(r);
  }
}

class Files {
 public:
  int Get(const SafetensorsFile* file) {
    auto it = fds_.find(file);
    if (it != fds_.end()) return it->second.get();
    UniqueFd fd(::open(file->path().c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd.valid()) ThrowErrno(file->path() + ": cannot open");
    return fds_.emplace(file, std::move(fd)).first->second.get();
  }

 private:
  std::map<const SafetensorsFile*, UniqueFd> fds_;
};

// Fills bytes [begin, end) of a segment from the tensors that overlap it.
void FillChunk(Segment& seg, uint64_t begin, uint64_t end, Files& files,
               std::vector<uint8_t>& buffer) {
  const auto& tensors = seg.info->tensors;
  // First tensor that ends after `begin` (tensors are sorted by offset).
  auto it =
      std::upper_bound(tensors.begin(), tensors.end(), begin,
                       [](uint64_t b, const TensorSlice& t) { return b < t.offset + t.nbytes; });
  for (; it != tensors.end() && it->offset < end; ++it) {
    const uint64_t piece_begin = std::max(begin, it->offset);
    const uint64_t piece_end = std::min(end, it->offset + it->nbytes);
    if (piece_begin >= piece_end) continue;
    const Checkpoint::Ref& src = (*seg.sources)[it - tensors.begin()];
    if (src.file == nullptr) continue;  // computed before the load (QuantizeSegments)
    const uint64_t src_base = src.file->header().data_offset + src.entry->begin;
    const uint64_t rel = piece_begin - it->offset;
    const int fd = files.Get(src.file);
    uint8_t* dst = seg.data + piece_begin;
    if (src.entry->dtype == it->dtype) {
      PreadExact(fd, dst, piece_end - piece_begin, src_base + rel, src.file->path());
    } else {
      const size_t dst_elem = DTypeSize(it->dtype), src_elem = DTypeSize(src.entry->dtype);
      const size_t count = (piece_end - piece_begin) / dst_elem;
      buffer.resize(count * src_elem);
      PreadExact(fd, buffer.data(), buffer.size(), src_base + rel / dst_elem * src_elem,
                 src.file->path());
      ConvertToBF16(src.entry->dtype, buffer.data(), reinterpret_cast<uint16_t*>(dst), count);
    }
  }
}

}  // namespace

LoadResult LoadSegments(PackPlan& plan, const std::vector<ShmSegment*>& shm, int threads,
                        const std::function<bool()>& should_stop, Progress* progress) {
  Manifest& m = plan.manifest;
  LS_CHECK(shm.size() == m.blocks.size() + 1, "one segment per block plus the rest");
  std::vector<Segment> segs;
  for (size_t i = 0; i < m.blocks.size(); ++i)
    segs.push_back({&m.blocks[i], &plan.block_sources[i], shm[i]->mutable_data(), {}});
  segs.push_back({&m.rest, &plan.rest_sources, shm.back()->mutable_data(), {}});
  std::vector<std::pair<size_t, size_t>> items;  // (segment, chunk)
  LoadResult result;
  for (size_t s = 0; s < segs.size(); ++s) {
    const size_t chunks = (segs[s].info->nbytes + kChecksumChunkBytes - 1) / kChecksumChunkBytes;
    segs[s].chunk_hashes.resize(chunks);
    for (size_t c = 0; c < chunks; ++c) items.emplace_back(s, c);
    result.bytes += segs[s].info->nbytes;
  }

  if (progress) progress->BeginPhase("reading", result.bytes);
  const auto start = std::chrono::steady_clock::now();
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex error_mutex;
  std::exception_ptr error;
  auto work = [&] {
    Files files;
    std::vector<uint8_t> buffer;
    try {
      for (size_t k; !failed && (k = next.fetch_add(1)) < items.size();) {
        if (should_stop && should_stop())
          throw Error(ErrorCode::kCancelled, "loading interrupted by a signal");
        Segment& seg = segs[items[k].first];
        const uint64_t begin = items[k].second * kChecksumChunkBytes;
        const uint64_t end = std::min<uint64_t>(begin + kChecksumChunkBytes, seg.info->nbytes);
        // Piece by piece, so that each piece is hashed while it is still in cache.
        BulkHasher hasher;
        for (uint64_t piece = begin; piece < end; piece += kPieceBytes) {
          const uint64_t piece_end = std::min(piece + kPieceBytes, end);
          FillChunk(seg, piece, piece_end, files, buffer);
          hasher.Update(seg.data + piece, piece_end - piece);
          if (progress) progress->Add(piece_end - piece);
        }
        seg.chunk_hashes[items[k].second] = hasher.Finish();
      }
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
      failed = true;
    }
  };
  std::vector<std::thread> pool;
  for (int i = 1; i < std::max(1, threads); ++i) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
  if (error) std::rethrow_exception(error);
  if (progress) progress->EndPhase();
  for (Segment& seg : segs)
    seg.info->checksum = CombineChunkHashes(seg.chunk_hashes, seg.info->nbytes);
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

}  // namespace lorastream::store
