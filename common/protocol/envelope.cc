#include "common/protocol/envelope.h"

#include <cstring>

#include "common/base/error.h"

namespace lorastream {
namespace {

void PutLe(std::string* out, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out->push_back(static_cast<char>((value >> (8 * i)) & 0xff));
}

uint64_t GetLe(const unsigned char* p, int bytes) {
  uint64_t value = 0;
  for (int i = bytes - 1; i >= 0; --i) value = (value << 8) | p[i];
  return value;
}

std::string Hex(uint32_t value) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "0x%08x", value);
  return buf;
}

}  // namespace

std::string EncodeEnvelope(uint16_t type, uint32_t request_id, std::string_view payload) {
  if (payload.size() > kMaxPayloadBytes)
    throw Error(ErrorCode::kProtocol, "message of type " + std::to_string(type) + " has " +
                                          std::to_string(payload.size()) +
                                          " payload bytes, above the cap of " +
                                          std::to_string(kMaxPayloadBytes));
  std::string out;
  out.reserve(kEnvelopeHeaderBytes + payload.size());
  PutLe(&out, kEnvelopeMagic, 4);
  PutLe(&out, kProtocolVersion, 2);
  PutLe(&out, type, 2);
  PutLe(&out, request_id, 4);
  PutLe(&out, payload.size(), 4);
  out.append(payload.data(), payload.size());
  return out;
}

Envelope DecodeEnvelope(const void* data, size_t size, size_t max_payload) {
  const auto* p = static_cast<const unsigned char*>(data);
  if (size < kEnvelopeHeaderBytes)
    throw Error(ErrorCode::kCorrupt, "message truncated: " + std::to_string(size) +
                                         " bytes, the envelope header alone needs " +
                                         std::to_string(kEnvelopeHeaderBytes));
  Envelope env;
  env.header.magic = static_cast<uint32_t>(GetLe(p, 4));
  env.header.version = static_cast<uint16_t>(GetLe(p + 4, 2));
  env.header.type = static_cast<uint16_t>(GetLe(p + 6, 2));
  env.header.request_id = static_cast<uint32_t>(GetLe(p + 8, 4));
  env.header.payload_size = static_cast<uint32_t>(GetLe(p + 12, 4));
  if (env.header.magic != kEnvelopeMagic)
    throw Error(ErrorCode::kCorrupt, "not a lorastream message: magic " + Hex(env.header.magic) +
                                         ", expected " + Hex(kEnvelopeMagic));
  if (env.header.version != kProtocolVersion)
    throw Error(ErrorCode::kProtocol,
                "message speaks protocol version " + std::to_string(env.header.version) +
                    ", this build speaks version " + std::to_string(kProtocolVersion));
  if (env.header.payload_size > max_payload)
    throw Error(ErrorCode::kProtocol, "oversized message: payload of " +
                                          std::to_string(env.header.payload_size) +
                                          " bytes, cap is " + std::to_string(max_payload));
  size_t actual = size - kEnvelopeHeaderBytes;
  if (actual != env.header.payload_size)
    throw Error(ErrorCode::kCorrupt,
                std::string(actual < env.header.payload_size ? "message truncated"
                                                             : "message has trailing bytes") +
                    ": header announces " + std::to_string(env.header.payload_size) +
                    " payload bytes, frame carries " + std::to_string(actual));
  env.payload = std::string_view(reinterpret_cast<const char*>(p + kEnvelopeHeaderBytes), actual);
  return env;
}

std::optional<uint32_t> PeekRequestId(const void* data, size_t size) {
  const auto* p = static_cast<const unsigned char*>(data);
  if (size < kEnvelopeHeaderBytes || GetLe(p, 4) != kEnvelopeMagic) return std::nullopt;
  return static_cast<uint32_t>(GetLe(p + 8, 4));
}

}  // namespace lorastream
