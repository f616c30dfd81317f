// cereal archives for protocol payloads. Why not cereal's BinaryInputArchive: it trusts the
// sizes it reads (a string or vector length of 2^60 from a hostile peer becomes a huge
// allocation) and loads any byte into a bool. These archives read from a bounded buffer,
// refuse a length larger than the bytes that remain, grow vectors element by element and
// accept only 0/1 for bools, so every malformed payload becomes Error(kCorrupt).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include <cereal/cereal.hpp>

#include "common/base/error.h"

namespace lorastream {

class MessageOutputArchive
    : public cereal::OutputArchive<MessageOutputArchive, cereal::AllowEmptyClassElision> {
 public:
  explicit MessageOutputArchive(std::string* out) : OutputArchive(this), out_(out) {}
  void SaveBinary(const void* data, size_t size) {
    out_->append(static_cast<const char*>(data), size);
  }

 private:
  std::string* out_;
};

class MessageInputArchive
    : public cereal::InputArchive<MessageInputArchive, cereal::AllowEmptyClassElision> {
 public:
  MessageInputArchive(const char* data, size_t size)
      : InputArchive(this), data_(data), size_(size) {}

  void LoadBinary(void* out, size_t size) {
    if (size > remaining())
      throw Error(ErrorCode::kCorrupt, "message payload truncated: needs " + std::to_string(size) +
                                           " bytes at offset " + std::to_string(pos_) + " of " +
                                           std::to_string(size_));
    std::memcpy(out, data_ + pos_, size);
    pos_ += size;
  }
  // A count read from the wire is trusted only when at least that many bytes remain (every
  // element of every message type occupies at least one byte).
  void CheckCount(uint64_t count, const char* what) const {
    if (count > remaining())
      throw Error(ErrorCode::kCorrupt, std::string("message payload: ") + what + " length " +
                                           std::to_string(count) + " exceeds the " +
                                           std::to_string(remaining()) + " bytes left");
  }
  size_t remaining() const { return size_ - pos_; }

 private:
  const char* data_;
  size_t size_;
  size_t pos_ = 0;
};

template <class T>
std::enable_if_t<std::is_arithmetic<T>::value> CEREAL_SAVE_FUNCTION_NAME(MessageOutputArchive& ar,
                                                                         const T& value) {
  ar.SaveBinary(&value, sizeof(value));
}

template <class T>
std::enable_if_t<std::is_arithmetic<T>::value && !std::is_same<T, bool>::value>
CEREAL_LOAD_FUNCTION_NAME(MessageInputArchive& ar, T& value) {
  ar.LoadBinary(&value, sizeof(value));
}

inline void CEREAL_LOAD_FUNCTION_NAME(MessageInputArchive& ar, bool& value) {
  uint8_t byte = 0;
  ar.LoadBinary(&byte, 1);
  if (byte > 1)
    throw Error(ErrorCode::kCorrupt, "message payload: bool field holds " + std::to_string(byte));
  value = byte == 1;
}

inline void CEREAL_SAVE_FUNCTION_NAME(MessageOutputArchive& ar, const std::string& s) {
  uint64_t size = s.size();
  ar.SaveBinary(&size, sizeof(size));
  ar.SaveBinary(s.data(), s.size());
}

inline void CEREAL_LOAD_FUNCTION_NAME(MessageInputArchive& ar, std::string& s) {
  uint64_t size = 0;
  ar.LoadBinary(&size, sizeof(size));
  ar.CheckCount(size, "string");
  s.resize(size);
  ar.LoadBinary(&s[0], size);
}

template <class T>
void CEREAL_SAVE_FUNCTION_NAME(MessageOutputArchive& ar, const std::vector<T>& v) {
  static_assert(!std::is_same<T, bool>::value, "vector<bool> is not a message field");
  uint64_t size = v.size();
  ar.SaveBinary(&size, sizeof(size));
  for (const T& element : v) ar(element);
}

template <class T>
void CEREAL_LOAD_FUNCTION_NAME(MessageInputArchive& ar, std::vector<T>& v) {
  uint64_t size = 0;
  ar.LoadBinary(&size, sizeof(size));
  ar.CheckCount(size, "list");
  v.clear();
  v.reserve(std::min<uint64_t>(size, 1024));
  for (uint64_t i = 0; i < size; ++i) {
    v.emplace_back();
    ar(v.back());
  }
}

// Enums travel as int32 and are range-checked on load (a stale or hostile peer may send any
// value; an out-of-range enum would otherwise flow into switch statements).
template <class Archive, class E>
void SerializeEnum(Archive& ar, E& value, E max_value) {
  int32_t raw = static_cast<int32_t>(value);
  ar(raw);
  if (raw < 0 || raw > static_cast<int32_t>(max_value))
    throw Error(ErrorCode::kCorrupt,
                "message payload: enum value " + std::to_string(raw) + " out of range");
  value = static_cast<E>(raw);
}

}  // namespace lorastream

CEREAL_SETUP_ARCHIVE_TRAITS(lorastream::MessageInputArchive, lorastream::MessageOutputArchive)
