// The versioned envelope around every protocol message (one ZeroMQ frame):
//
//   offset 0  u32 magic "LSTR"   offset 4  u16 protocol version   offset 6  u16 message type
//   offset 8  u32 request id     offset 12 u32 payload size       offset 16 payload (cereal)
//
// Little-endian. The request id lets a DEALER match a reply to its request and drop a late
// reply to a request that already timed out. Decoding checks the header before anything
// trusts it: a short frame, a foreign magic, another protocol version, a payload above the cap
// or a size that disagrees with the frame are distinct errors (kCorrupt / kProtocol).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace lorastream {

constexpr uint32_t kEnvelopeMagic = 0x5254534C;  // "LSTR" in little-endian byte order
constexpr uint16_t kProtocolVersion = 3;         // 2: workers with job slots; 3: FLUX jobs
constexpr size_t kEnvelopeHeaderBytes = 16;
constexpr size_t kMaxPayloadBytes = 16u << 20;  // 16 MiB: far above any real message

struct EnvelopeHeader {
  uint32_t magic = kEnvelopeMagic;
  uint16_t version = kProtocolVersion;
  uint16_t type = 0;
  uint32_t request_id = 0;
  uint32_t payload_size = 0;
};

struct Envelope {
  EnvelopeHeader header;
  std::string_view payload;  // points into the decoded buffer
};

// Throws Error(kProtocol) when the payload exceeds kMaxPayloadBytes.
std::string EncodeEnvelope(uint16_t type, uint32_t request_id, std::string_view payload);

// Throws Error(kCorrupt) for a short frame, bad magic or size mismatch, Error(kProtocol) for
// another version or an oversized payload. Does not judge the type (messages.h does).
Envelope DecodeEnvelope(const void* data, size_t size, size_t max_payload = kMaxPayloadBytes);

// The request id of a frame that may not decode, so that even the error reply to a garbage
// frame can carry it; nullopt when the frame is too short or not ours.
std::optional<uint32_t> PeekRequestId(const void* data, size_t size);

}  // namespace lorastream
