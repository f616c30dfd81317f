// Writing .safetensors files: header padded with spaces so that the data section starts on
// an `alignment` boundary; tensors follow each other WITHOUT gaps, because the reference
// reader (the `safetensors` Rust crate behind Python's safetensors, transformers and peft)
// rejects data_offsets that are not contiguous ("invalid offset"). Written under a temporary
// name and renamed so that a reader never sees half a file.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <future>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/base/error.h"
#include "common/formats/safetensors.h"
#include "common/posix/unique_fd.h"

namespace lorastream {

namespace {

uint64_t RoundUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

void PwriteAll(int fd, const uint8_t* p, size_t n, uint64_t at, const std::string& path) {
  while (n > 0) {
    ssize_t w = ::pwrite(fd, p, n, static_cast<off_t>(at));
    if (w < 0) {
      if (errno == EINTR) continue;
      ThrowErrno(path + ": write failed");
    }
    p += w;
    n -= static_cast<size_t>(w);
    at += static_cast<uint64_t>(w);
  }
}

// Removes the temporary file unless Commit() renamed it into place.
class TempFile {
 public:
  explicit TempFile(const std::string& path)
      : path_(path), temp_(path + ".tmp." + std::to_string(::getpid())) {
    fd_.Reset(::open(temp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (!fd_.valid()) ThrowErrno(temp_ + ": cannot create");
  }
  ~TempFile() {
    fd_.Reset();
    if (!committed_) ::unlink(temp_.c_str());
  }
  int fd() const { return fd_.get(); }
  const std::string& temp() const { return temp_; }
  void Commit() {
    // close's own result matters here (a delayed write error), so it is not left to Reset.
    if (::close(fd_.Release()) != 0) ThrowErrno(temp_ + ": close failed");
    if (::rename(temp_.c_str(), path_.c_str()) != 0) ThrowErrno(path_ + ": rename failed");
    committed_ = true;
  }

 private:
  std::string path_, temp_;
  UniqueFd fd_;
  bool committed_ = false;
};

}  // namespace

uint64_t TensorBytes(const TensorToWrite& t) {
  uint64_t n = DTypeSize(t.dtype);
  for (int64_t d : t.shape) {
    if (d < 0)
      throw Error(ErrorCode::kInvalidArgument, "tensor `" + t.name + "`: negative dimension");
    n *= static_cast<uint64_t>(d);
  }
  return n;
}

void WriteSafetensorsStreamed(const std::string& path, const std::vector<TensorToWrite>& tensors,
                              const TensorFiller& fill,
                              const std::map<std::string, std::string>& metadata, size_t alignment,
                              size_t chunk_bytes) {
  if (alignment == 0 || (alignment & (alignment - 1)) != 0 || alignment > 4096)
    throw Error(ErrorCode::kInvalidArgument, path + ": alignment must be a power of two <= 4096");
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<uint64_t> begins;
  uint64_t offset = 0;
  for (const TensorToWrite& t : tensors) {
    if (t.name.empty() || t.name == "__metadata__" || header.contains(t.name))
      throw Error(ErrorCode::kInvalidArgument,
                  path + ": bad or duplicate tensor name `" + t.name + "`");
    const uint64_t n = TensorBytes(t);
    begins.push_back(offset);
    header[t.name] = {
        {"dtype", DTypeName(t.dtype)}, {"shape", t.shape}, {"data_offsets", {offset, offset + n}}};
    offset += n;
  }
  std::string text = header.dump();
  text.resize(RoundUp(8 + text.size(), alignment) - 8, ' ');
  std::vector<uint8_t> prefix(8 + text.size());
  for (int i = 0; i < 8; ++i) prefix[i] = static_cast<uint8_t>(uint64_t{text.size()} >> (8 * i));
  std::copy(text.begin(), text.end(), prefix.begin() + 8);

  TempFile file(path);
  PwriteAll(file.fd(), prefix.data(), prefix.size(), 0, file.temp());
  // Double buffering: the next chunk is generated while the previous one is written (pwrite
  // at explicit offsets, so the two writes may finish in any order).
  std::vector<uint8_t> buffers[2];
  std::future<void> writes[2];  // declared after `file`: joined before it closes
  int current = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const uint64_t n = TensorBytes(tensors[i]);
    for (uint64_t done = 0; done < n;) {
      const size_t step = static_cast<size_t>(std::min<uint64_t>(chunk_bytes, n - done));
      if (writes[current].valid()) writes[current].get();
      std::vector<uint8_t>& buffer = buffers[current];
      buffer.resize(step);
      fill(i, done, buffer.data(), step);
      const uint64_t at = prefix.size() + begins[i] + done;
      writes[current] = std::async(std::launch::async, [&file, &buffer, step, at] {
        PwriteAll(file.fd(), buffer.data(), step, at, file.temp());
      });
      current ^= 1;
      done += step;
    }
  }
  for (std::future<void>& w : writes)
    if (w.valid()) w.get();
  if (::ftruncate(file.fd(), static_cast<off_t>(prefix.size() + offset)) != 0)
    ThrowErrno(file.temp() + ": truncate failed");
  file.Commit();
}

void WriteSafetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                      const std::map<std::string, std::string>& metadata, size_t alignment) {
  for (const TensorToWrite& t : tensors)
    if (t.data == nullptr && TensorBytes(t) != 0)
      throw Error(ErrorCode::kInvalidArgument, path + ": tensor `" + t.name + "` has no data");
  WriteSafetensorsStreamed(
      path, tensors,
      [&](size_t index, uint64_t offset, uint8_t* out, size_t n) {
        std::copy_n(static_cast<const uint8_t*>(tensors[index].data) + offset, n, out);
      },
      metadata, alignment);
}

}  // namespace lorastream
