#include "common/posix/shm_names.h"

#include <cinttypes>
#include <cstdio>

#include "common/base/error.h"

namespace lorastream {

void ValidateStoreName(const std::string& name) {
  bool ok = !name.empty() && name.size() <= 64;
  for (char c : name)
    ok = ok && ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                c == '_' || c == '-');
  if (!ok)
    throw Error(ErrorCode::kInvalidArgument,
                "store name `" + name + "` must be 1-64 characters of letters, digits, _ and -");
}

std::string ShmPrefix(const std::string& store_name) { return "lorastream." + store_name + "."; }

std::string ManifestShmName(const std::string& store_name) {
  return "/" + ShmPrefix(store_name) + "manifest";
}

std::string BlockShmName(const std::string& store_name, uint64_t generation, int block) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%016" PRIx64 ".block.%04d", generation, block);
  return "/" + ShmPrefix(store_name) + buf;
}

std::string RestShmName(const std::string& store_name, uint64_t generation) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%016" PRIx64 ".rest", generation);
  return "/" + ShmPrefix(store_name) + buf;
}

StoreOffer ParseStoreOffer(const std::string& text) {
  const size_t eq = text.find('=');
  StoreOffer offer;
  offer.name = eq == std::string::npos ? text : text.substr(eq + 1);
  offer.offered_as = eq == std::string::npos ? text : text.substr(0, eq);
  try {
    ValidateStoreName(offer.offered_as);
    ValidateStoreName(offer.name);
  } catch (const Error& e) {
    throw Error(ErrorCode::kInvalidArgument,
                "--store `" + text +
                    "` (NAME, or AS=NAME to offer store NAME to jobs naming AS): " + e.what());
  }
  return offer;
}

}  // namespace lorastream
