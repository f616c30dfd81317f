#include "common/formats/npz.h"

#include <zlib.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <limits>

#include "common/base/error.h"
#include "common/posix/durable_file.h"
#include "common/posix/regular_file.h"

namespace lorastream {

namespace {

[[noreturn]] void Corrupt(const std::string& what, const std::string& why) {
  throw Error(ErrorCode::kCorrupt, what + ": " + why);
}

uint64_t Le(const uint8_t* p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

void PutLe(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1f;
  const uint32_t mant = h & 0x3ff;
  float f;
  if (exp == 0) {
    f = static_cast<float>(mant) * (1.0f / 16777216.0f);  // subnormal: mant * 2^-24
    if (sign) f = -f;
    return f;
  }
  const uint32_t bits =
      exp == 31 ? sign | 0x7f800000u | (mant << 13) : sign | ((exp + 112) << 23) | (mant << 13);
  std::memcpy(&f, &bits, 4);
  return f;
}

// The value of `key` in numpy's header dict, e.g. "'<f4'" or "(16, 128, 128)"; "" if absent.
std::string DictValue(const std::string& dict, const std::string& key) {
  const std::string quoted = "'" + key + "'";
  size_t p = dict.find(quoted);
  if (p == std::string::npos) return "";
  p = dict.find(':', p + quoted.size());
  if (p == std::string::npos) return "";
  ++p;
  while (p < dict.size() && dict[p] == ' ') ++p;
  if (p >= dict.size()) return "";
  const char open = dict[p];
  const char close = open == '(' ? ')' : open == '\'' ? '\'' : ',';
  const size_t end = dict.find(close, p + 1);
  if (end == std::string::npos) return "";
  return dict.substr(p, end - p + (close == ',' ? 0 : 1));
}

}  // namespace

int64_t NpyArray::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::vector<float> NpyArray::ToFloat(const std::string& what) const {
  const int64_t n = numel();
  std::vector<float> out(static_cast<size_t>(n));
  const uint8_t* p = data.data();
  for (int64_t i = 0; i < n; ++i, p += itemsize) {
    float v;
    if (kind == 'f' && itemsize == 4) {
      std::memcpy(&v, p, 4);
    } else if (kind == 'f' && itemsize == 2) {
      v = HalfToFloat(static_cast<uint16_t>(Le(p, 2)));
    } else if (kind == 'f' && itemsize == 8) {
      double d;
      std::memcpy(&d, p, 8);
      v = static_cast<float>(d);
    } else if (kind == 'i') {
      const uint64_t u = Le(p, itemsize);
      const int shift = 64 - 8 * itemsize;
      v = static_cast<float>(static_cast<int64_t>(u << shift) >> shift);
    } else if (kind == 'u' || kind == 'b') {
      v = static_cast<float>(Le(p, itemsize));
    } else {
      Corrupt(what, std::string("dtype kind '") + kind + "' of " + std::to_string(itemsize) +
                        " bytes is not a number this reader converts");
    }
    out[static_cast<size_t>(i)] = v;
  }
  return out;
}

NpyArray ParseNpy(const uint8_t* data, size_t size, const std::string& what) {
  static const uint8_t kMagic[6] = {0x93, 'N', 'U', 'M', 'P', 'Y'};
  if (size < 10 || std::memcmp(data, kMagic, 6) != 0) Corrupt(what, "not a .npy array (no magic)");
  const int major = data[6];
  if (major < 1 || major > 3) Corrupt(what, ".npy format version " + std::to_string(major));
  const size_t len_bytes = major == 1 ? 2 : 4;
  if (size < 8 + len_bytes) Corrupt(what, ".npy header runs past the end (truncated)");
  const size_t header_len = Le(data + 8, static_cast<int>(len_bytes));
  const size_t start = 8 + len_bytes + header_len;
  if (start > size) Corrupt(what, ".npy header runs past the end (truncated)");
  const std::string dict(reinterpret_cast<const char*>(data + 8 + len_bytes), header_len);

  NpyArray a;
  const std::string descr = DictValue(dict, "descr");
  if (descr.size() != 5 || descr.front() != '\'')
    Corrupt(what, "unsupported or missing descr " + (descr.empty() ? "(none)" : descr));
  const char order = descr[1];
  a.kind = descr[2];
  a.itemsize = descr[3] - '0';
  if (order == '>' && a.itemsize > 1) Corrupt(what, "big-endian arrays are not read");
  if (std::string("fiub").find(a.kind) == std::string::npos ||
      (a.itemsize != 1 && a.itemsize != 2 && a.itemsize != 4 && a.itemsize != 8))
    Corrupt(what, "unsupported dtype " + descr);
  if (DictValue(dict, "fortran_order") != "True" && DictValue(dict, "fortran_order") != "False")
    Corrupt(what, "missing fortran_order");
  if (DictValue(dict, "fortran_order") == "True")
    Corrupt(what, "Fortran-ordered arrays are not read");
  const std::string shape = DictValue(dict, "shape");
  if (shape.size() < 2 || shape.front() != '(') Corrupt(what, "missing shape");
  size_t p = 1;
  while (p < shape.size() - 1) {
    while (p < shape.size() - 1 && (shape[p] == ' ' || shape[p] == ',')) ++p;
    if (p >= shape.size() - 1) break;
    size_t q = p;
    while (q < shape.size() - 1 && shape[q] >= '0' && shape[q] <= '9') ++q;
    if (q == p || q - p > 12) Corrupt(what, "malformed shape " + shape);
    a.shape.push_back(std::stoll(shape.substr(p, q - p)));
    p = q;
  }
  uint64_t bytes = static_cast<uint64_t>(a.itemsize);
  for (int64_t d : a.shape) {
    if (d > 0 && bytes > std::numeric_limits<uint64_t>::max() / static_cast<uint64_t>(d))
      Corrupt(what, "shape " + shape + " overflows");
    bytes *= static_cast<uint64_t>(d);
  }
  if (bytes != size - start)
    Corrupt(what, "shape " + shape + " needs " + std::to_string(bytes) + " bytes of data, " +
                      std::to_string(size - start) + " present" +
                      (bytes > size - start ? " (truncated)" : ""));
  a.data.assign(data + start, data + size);
  return a;
}

std::map<std::string, NpyArray> ParseNpz(const uint8_t* data, size_t size, const std::string& what,
                                         uint64_t max_bytes) {
  // The end of central directory record: the last 22 bytes plus a comment of up to 64 KiB.
  if (size < 22) Corrupt(what, "too short to be an .npz (zip) archive (truncated?)");
  size_t eocd = std::string::npos;
  for (size_t p = size - 22 + 1; p-- > 0 && size - p <= 22 + 65535;) {
    if (Le(data + p, 4) == 0x06054b50) {
      eocd = p;
      break;
    }
  }
  if (eocd == std::string::npos) Corrupt(what, "no zip end-of-directory record (truncated?)");
  uint64_t entries = Le(data + eocd + 10, 2);
  uint64_t dir_size = Le(data + eocd + 12, 4);
  uint64_t dir_offset = Le(data + eocd + 16, 4);
  if (eocd >= 20 && Le(data + eocd - 20, 4) == 0x07064b50) {  // zip64 locator
    const uint64_t z64 = Le(data + eocd - 20 + 8, 8);
    if (z64 > size || size - z64 < 56 || Le(data + z64, 4) != 0x06064b50)
      Corrupt(what, "bad zip64 directory");
    entries = Le(data + z64 + 32, 8);
    dir_size = Le(data + z64 + 40, 8);
    dir_offset = Le(data + z64 + 48, 8);
  }
  if (dir_offset > size || dir_size > size - dir_offset)
    Corrupt(what, "zip directory runs past the end (truncated)");

  std::map<std::string, NpyArray> out;
  uint64_t inflated = 0;  // the members' declared sizes so far
  size_t p = dir_offset;
  for (uint64_t e = 0; e < entries; ++e) {
    if (p + 46 > dir_offset + dir_size || Le(data + p, 4) != 0x02014b50)
      Corrupt(what, "zip directory entry " + std::to_string(e) + " is damaged");
    const uint64_t method = Le(data + p + 10, 2);
    const uint32_t crc = static_cast<uint32_t>(Le(data + p + 16, 4));
    uint64_t csize = Le(data + p + 20, 4);
    uint64_t usize = Le(data + p + 24, 4);
    const size_t name_len = Le(data + p + 28, 2);
    const size_t extra_len = Le(data + p + 30, 2);
    const size_t comment_len = Le(data + p + 32, 2);
    uint64_t local = Le(data + p + 42, 4);
    const size_t next = p + 46 + name_len + extra_len + comment_len;
    if (next > dir_offset + dir_size) Corrupt(what, "zip directory entry runs past its end");
    std::string name(reinterpret_cast<const char*>(data + p + 46), name_len);
    // zip64: the sizes and offset that did not fit 32 bits follow in extra field 0x0001.
    for (size_t x = p + 46 + name_len; x + 4 <= p + 46 + name_len + extra_len;) {
      const uint64_t id = Le(data + x, 2), len = Le(data + x + 2, 2);
      if (x + 4 + len > p + 46 + name_len + extra_len)
        Corrupt(what, "zip directory entry " + name + ": extra field runs past its end");
      size_t f = x + 4;
      if (id == 1) {
        if (usize == 0xffffffffu && f + 8 <= x + 4 + len) usize = Le(data + f, 8), f += 8;
        if (csize == 0xffffffffu && f + 8 <= x + 4 + len) csize = Le(data + f, 8), f += 8;
        if (local == 0xffffffffu && f + 8 <= x + 4 + len) local = Le(data + f, 8), f += 8;
      }
      x += 4 + len;
    }
    const std::string member = what + ": member " + name;
    if (local > size || size - local < 30 || Le(data + local, 4) != 0x04034b50)
      Corrupt(member, "local header missing (truncated?)");
    const uint64_t start = local + 30 + Le(data + local + 26, 2) + Le(data + local + 28, 2);
    if (start > size || csize > size - start) Corrupt(member, "data runs past the end (truncated)");
    if (usize > max_bytes || inflated + usize > max_bytes)
      Corrupt(member, "declares " + std::to_string(usize) +
                          " bytes, which with the members "
                          "before it exceeds the limit of " +
                          std::to_string(max_bytes) + " bytes for this archive");
    inflated += usize;
    std::vector<uint8_t> bytes;
    if (method == 0) {
      if (csize != usize) Corrupt(member, "stored member with two different sizes");
      bytes.assign(data + start, data + start + csize);
    } else if (method == 8) {
      // deflate expands at most 1032:1: a larger claim is damage, not a reason to allocate
      if (usize > (uint64_t{1} << 34) || usize > csize * 1032 + 64)
        Corrupt(member, "inflated size " + std::to_string(usize) + " impossible for " +
                            std::to_string(csize) + " compressed bytes");
      bytes.resize(usize);
      z_stream z{};
      if (inflateInit2(&z, -MAX_WBITS) != Z_OK) Corrupt(member, "zlib inflateInit failed");
      z.next_in = const_cast<Bytef*>(data + start);
      z.avail_in = static_cast<uInt>(csize);
      z.next_out = bytes.data();
      z.avail_out = static_cast<uInt>(usize);
      const int rc = inflate(&z, Z_FINISH);
      const uint64_t produced = z.total_out;
      inflateEnd(&z);
      if (rc != Z_STREAM_END || produced != usize) Corrupt(member, "deflate data is damaged");
    } else {
      Corrupt(member, "compression method " + std::to_string(method) + " (stored or deflate only)");
    }
    if (static_cast<uint32_t>(crc32(0L, bytes.data(), static_cast<uInt>(bytes.size()))) != crc)
      Corrupt(member, "CRC-32 mismatch (damaged)");
    if (name.size() > 4 && name.compare(name.size() - 4, 4, ".npy") == 0)
      name.resize(name.size() - 4);
    out[name] = ParseNpy(bytes.data(), bytes.size(), member);
    p = next;
  }
  return out;
}

std::map<std::string, NpyArray> ReadNpz(const std::string& path, uint64_t max_bytes) {
  // Bounded and regular only: a link to /dev/zero would otherwise be read until memory ends,
  // and a FIFO would block the reader.
  const std::string bytes = ReadRegularFile(path, max_bytes);
  return ParseNpz(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), path, max_bytes);
}

void WriteNpz(const std::string& path, const std::map<std::string, NpyArray>& arrays,
              bool compressed) {
  std::string out, dir;
  for (const auto& [name, a] : arrays) {
    std::string shape = "(";
    for (size_t i = 0; i < a.shape.size(); ++i)
      shape += (i ? ", " : "") + std::to_string(a.shape[i]);
    shape += a.shape.size() == 1 ? ",)" : ")";
    std::string dict = std::string("{'descr': '") + (a.itemsize == 1 ? '|' : '<') + a.kind +
                       std::to_string(a.itemsize) + "', 'fortran_order': False, 'shape': " + shape +
                       ", }";
    while ((10 + dict.size() + 1) % 64 != 0) dict.push_back(' ');
    dict.push_back('\n');
    std::string npy("\x93NUMPY\x01\x00", 8);
    PutLe(npy, dict.size(), 2);
    npy += dict;
    npy.append(reinterpret_cast<const char*>(a.data.data()), a.data.size());
    const uint32_t crc = static_cast<uint32_t>(
        crc32(0L, reinterpret_cast<const Bytef*>(npy.data()), static_cast<uInt>(npy.size())));
    std::string body = npy;
    if (compressed) {
      body.resize(compressBound(static_cast<uLong>(npy.size())) + 64);
      z_stream z{};
      LS_CHECK(deflateInit2(&z, 6, Z_DEFLATED, -MAX_WBITS, 8, Z_DEFAULT_STRATEGY) == Z_OK,
               "deflateInit2");
      z.next_in = reinterpret_cast<Bytef*>(npy.data());
      z.avail_in = static_cast<uInt>(npy.size());
      z.next_out = reinterpret_cast<Bytef*>(body.data());
      z.avail_out = static_cast<uInt>(body.size());
      LS_CHECK(deflate(&z, Z_FINISH) == Z_STREAM_END, "deflate");
      body.resize(z.total_out);
      deflateEnd(&z);
    }
    const std::string member = name + ".npy";
    const int method = compressed ? 8 : 0;
    const uint64_t local = out.size();
    PutLe(out, 0x04034b50, 4);
    PutLe(out, 45, 2);  // version 4.5: zip64
    PutLe(out, 0, 2);
    PutLe(out, method, 2);
    PutLe(out, 0, 4);  // time, date
    PutLe(out, crc, 4);
    PutLe(out, 0xffffffffu, 4);  // sizes in the zip64 extra field below
    PutLe(out, 0xffffffffu, 4);
    PutLe(out, member.size(), 2);
    PutLe(out, 20, 2);
    out += member;
    PutLe(out, 1, 2);
    PutLe(out, 16, 2);
    PutLe(out, npy.size(), 8);
    PutLe(out, body.size(), 8);
    out += body;
    PutLe(dir, 0x02014b50, 4);
    PutLe(dir, 45, 2);
    PutLe(dir, 45, 2);
    PutLe(dir, 0, 2);
    PutLe(dir, method, 2);
    PutLe(dir, 0, 4);
    PutLe(dir, crc, 4);
    PutLe(dir, body.size(), 4);
    PutLe(dir, npy.size(), 4);
    PutLe(dir, member.size(), 2);
    for (int i = 0; i < 4; ++i) PutLe(dir, 0, 2);  // extra, comment, disk, internal attributes
    PutLe(dir, 0, 4);
    PutLe(dir, local, 4);
    dir += member;
  }
  const uint64_t dir_offset = out.size();
  out += dir;
  PutLe(out, 0x06054b50, 4);
  PutLe(out, 0, 4);
  PutLe(out, arrays.size(), 2);
  PutLe(out, arrays.size(), 2);
  PutLe(out, dir.size(), 4);
  PutLe(out, dir_offset, 4);
  PutLe(out, 0, 2);
  WriteFileDurably(path, out);
}

}  // namespace lorastream
