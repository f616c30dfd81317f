// NumPy's .npy arrays and .npz archives (a zip of .npy members, stored or deflated, zip64
// included as numpy writes it), read without Python or LibTorch. The diffusion trainers'
// caches (sd-scripts' latents and text-encoder outputs) are .npz files; common/formats/flux_cache.h
// reads them through this.
//
// Everything is validated before it is trusted: the zip's central directory, each member's
// local header, its CRC-32, the .npy header's dict (descr, fortran_order, shape) and that the
// data holds exactly shape x itemsize bytes. Failures throw Error(kCorrupt) naming the file
// and the member.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace lorastream {

struct NpyArray {
  char kind = 'f';   // numpy's kind: 'f' float, 'i' signed, 'u' unsigned, 'b' bool
  int itemsize = 4;  // bytes per element
  std::vector<int64_t> shape;
  std::vector<uint8_t> data;  // little-endian, C order

  int64_t numel() const;
  // The elements as float (f2, f4, f8, integers and bools converted); Error(kCorrupt) naming
  // `what` for another kind.
  std::vector<float> ToFloat(const std::string& what) const;
};

// One .npy image (`what` names it in errors).
NpyArray ParseNpy(const uint8_t* data, size_t size, const std::string& what);

// The most an archive may hold, in the file and inflated, unless the caller says less.
inline constexpr uint64_t kMaxNpzBytes = uint64_t{1} << 32;

// Every member of an .npz archive, by name without the ".npy" suffix. The file is opened only
// if it is a regular file (a FIFO or a device is refused at once, naming it) and refused when
// it, or its members inflated together, would exceed `max_bytes` (checked against the sizes
// the archive declares, before anything is inflated).
std::map<std::string, NpyArray> ReadNpz(const std::string& path, uint64_t max_bytes = kMaxNpzBytes);
// The same from bytes in memory (the fuzzer, tests).
std::map<std::string, NpyArray> ParseNpz(const uint8_t* data, size_t size, const std::string& what,
                                         uint64_t max_bytes = kMaxNpzBytes);

// Writes an .npz laid out as numpy writes one (tests, tools): members in map order, each
// local header in zip64 form (numpy forces it), stored as numpy.savez does or deflated as
// numpy.savez_compressed does.
void WriteNpz(const std::string& path, const std::map<std::string, NpyArray>& arrays,
              bool compressed = false);

}  // namespace lorastream
