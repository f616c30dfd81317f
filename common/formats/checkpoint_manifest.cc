#include "common/formats/checkpoint_manifest.h"

#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "common/base/error.h"
#include "common/base/sha256.h"
#include "common/posix/durable_file.h"
#include "common/posix/regular_file.h"

namespace lorastream {

namespace fs = std::filesystem;

namespace {

constexpr const char* kFormat = "lorastream-checkpoint-manifest";
constexpr size_t kMaxManifestFiles = 4096;
constexpr off_t kMaxManifestBytes = 1 << 20;

bool IsPlainFileName(const std::string& name) {
  return !name.empty() && name.size() <= 255 && name != "." && name != ".." &&
         name.find('/') == std::string::npos && name.find('\0') == std::string::npos;
}

bool IsHexDigest(const std::string& s) {
  return s.size() == 64 && std::all_of(s.begin(), s.end(), [](char c) {
           return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
         });
}

}  // namespace

std::string CheckpointManifestJson(const CheckpointManifest& manifest) {
  nlohmann::json files = nlohmann::json::array();
  for (const auto& f : manifest.files)
    files.push_back({{"name", f.name}, {"bytes", f.bytes}, {"sha256", f.sha256}});
  nlohmann::json j = {{"format", kFormat}, {"version", 1}, {"files", files}};
  return j.dump(1) + "\n";
}

CheckpointManifest ParseCheckpointManifest(const std::string& text, const std::string& source) {
  auto bad = [&](const std::string& why) { throw Error(ErrorCode::kCorrupt, source + ": " + why); };
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) bad("not a JSON object");
  auto format = j.find("format");
  auto version = j.find("version");
  if (format == j.end() || !format->is_string() || format->get<std::string>() != kFormat ||
      version == j.end() || !version->is_number_integer() || version->get<int64_t>() != 1)
    bad(std::string("not a version 1 ") + kFormat);
  auto files = j.find("files");
  if (files == j.end() || !files->is_array() || files->empty())
    bad("`files` must be a non-empty array");
  if (files->size() > kMaxManifestFiles) bad("`files` lists more than 4096 files");
  CheckpointManifest m;
  std::set<std::string> seen;
  for (size_t i = 0; i < files->size(); ++i) {
    const auto& f = (*files)[i];
    const std::string where = "`files[" + std::to_string(i) + "]`";
    if (!f.is_object()) bad(where + " is not an object");
    auto name = f.find("name");
    auto bytes = f.find("bytes");
    auto sha = f.find("sha256");
    if (name == f.end() || !name->is_string() || !IsPlainFileName(name->get<std::string>()) ||
        name->get<std::string>() == kCheckpointManifestFile)
      bad(where + ": `name` must be a plain file name");
    if (bytes == f.end() || !bytes->is_number_unsigned())
      bad(where + ": `bytes` must be a non-negative integer");
    if (sha == f.end() || !sha->is_string() || !IsHexDigest(sha->get<std::string>()))
      bad(where + ": `sha256` must be 64 lowercase hex characters");
    CheckpointFileDigest d;
    d.name = name->get<std::string>();
    d.bytes = bytes->get<uint64_t>();
    d.sha256 = sha->get<std::string>();
    if (!seen.insert(d.name).second) bad(where + ": `" + d.name + "` is listed twice");
    m.files.push_back(std::move(d));
  }
  return m;
}

void WriteCheckpointManifest(const std::string& dir) {
  CheckpointManifest m;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name == kCheckpointManifestFile || !entry.is_regular_file(ec)) continue;
    CheckpointFileDigest d;
    d.name = name;
    d.bytes = entry.file_size(ec);
    if (ec) throw Error(ErrorCode::kIo, "cannot stat " + entry.path().string());
    d.sha256 = Sha256OfFile(entry.path().string());
    m.files.push_back(std::move(d));
  }
  if (ec) throw Error(ErrorCode::kIo, "cannot list " + dir + ": " + ec.message());
  std::sort(m.files.begin(), m.files.end(),
            [](const auto& a, const auto& b) { return a.name < b.name; });
  // The data files first, the manifest last: a manifest never describes unsynced data.
  FsyncFolder(dir);
  WriteFileDurably((fs::path(dir) / kCheckpointManifestFile).string(), CheckpointManifestJson(m));
}

CheckpointManifest ReadCheckpointManifest(const std::string& dir,
                                          const std::vector<std::string>& required) {
  const std::string path = (fs::path(dir) / kCheckpointManifestFile).string();
  struct stat manifest_stat {};
  if (::stat(path.c_str(), &manifest_stat) == 0 && manifest_stat.st_size > kMaxManifestBytes)
    throw Error(ErrorCode::kCorrupt, path + ": larger than a manifest can be (1 MiB)");
  std::string text;
  try {
    text = ReadRegularFile(path, kMaxManifestBytes);
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kNotFound) throw;
    throw Error(ErrorCode::kCorrupt,
                path + ": missing (the checkpoint was not completed or was damaged)");
  }
  CheckpointManifest m = ParseCheckpointManifest(text, path);
  for (const auto& name : required)
    if (std::none_of(m.files.begin(), m.files.end(), [&](const auto& f) { return f.name == name; }))
      throw Error(ErrorCode::kCorrupt, path + ": does not list " + name);
  return m;
}

void VerifyCheckpointFiles(const std::string& dir, const std::vector<std::string>& required) {
  const std::string path = (fs::path(dir) / kCheckpointManifestFile).string();
  const CheckpointManifest m = ReadCheckpointManifest(dir, required);
  for (const auto& f : m.files) {
    const std::string file = (fs::path(dir) / f.name).string();
    struct stat st {};
    if (::lstat(file.c_str(), &st) != 0 || !S_ISREG(st.st_mode))
      throw Error(ErrorCode::kCorrupt, file + ": missing (listed in " + path + ")");
    if (static_cast<uint64_t>(st.st_size) != f.bytes)
      throw Error(ErrorCode::kCorrupt, file + ": " + std::to_string(st.st_size) +
                                           " bytes, the manifest recorded " +
                                           std::to_string(f.bytes));
    if (Sha256OfFile(file) != f.sha256)
      throw Error(ErrorCode::kCorrupt,
                  file + ": contents differ from the SHA-256 recorded in " + path);
  }
}

}  // namespace lorastream
