// Checkpoint: a Hugging Face folder (config.json + model.safetensors, or the shards named by
// model.safetensors.index.json). The index is cross-checked against the shards' headers.
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "common/base/error.h"
#include "common/formats/safetensors.h"
#include "common/posix/regular_file.h"

namespace lorastream {

namespace {

bool IsFile(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

bool IsDir(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

std::string ReadText(const std::string& path) { return ReadRegularFile(path, kMaxTextFileBytes); }

// weight_map of an index file: tensor name -> shard file name (validated).
std::map<std::string, std::string> ParseIndex(const std::string& path) {
  auto bad = [&](const std::string& why) { throw Error(ErrorCode::kCorrupt, path + ": " + why); };
  nlohmann::json j = nlohmann::json::parse(ReadText(path), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) bad("not valid JSON");
  if (!j.is_object()) bad("not a JSON object");
  auto wm = j.find("weight_map");
  if (wm == j.end()) bad("`weight_map` is missing");
  if (!wm->is_object() || wm->empty()) bad("`weight_map` must be a non-empty object");
  std::map<std::string, std::string> map;
  for (auto it = wm->begin(); it != wm->end(); ++it) {
    if (!it.value().is_string())
      bad("`weight_map` entry for tensor `" + it.key() + "` is not a file name");
    std::string shard = it.value().get<std::string>();
    if (shard.empty() || shard.find('/') != std::string::npos || shard == "." || shard == "..")
      bad("`weight_map` entry for tensor `" + it.key() + "` names `" + shard +
          "`, not a file in the checkpoint folder");
    map[it.key()] = shard;
  }
  return map;
}

}  // namespace

SafetensorsFolder SafetensorsFolder::Open(const std::string& dir, const std::string& stem) {
  SafetensorsFolder f;
  f.dir_ = dir;
  const std::string index_path = dir + "/" + stem + ".safetensors.index.json";
  const std::string single_path = dir + "/" + stem + ".safetensors";
  if (IsFile(index_path)) {
    const auto weight_map = ParseIndex(index_path);
    std::map<std::string, const SafetensorsFile*> shards;
    for (const auto& [tensor, shard] : weight_map) {
      if (shards.count(shard)) continue;
      const std::string shard_path = dir + "/" + shard;
      if (!IsFile(shard_path))
        throw Error(ErrorCode::kNotFound, index_path + ": shard `" + shard + "` (tensor `" +
                                              tensor + "`) does not exist");
      f.files_.push_back(std::make_unique<SafetensorsFile>(SafetensorsFile::Open(shard_path)));
      shards[shard] = f.files_.back().get();
    }
    for (const auto& [tensor, shard] : weight_map) {
      const SafetensorsFile* file = shards[shard];
      const SafetensorsEntry* entry = file->Find(tensor);
      if (!entry)
        throw Error(ErrorCode::kCorrupt, index_path + ": tensor `" + tensor +
                                             "` is assigned to shard `" + shard +
                                             "`, which does not hold it");
      f.by_name_[tensor] = Ref{file, entry};
    }
    // Every tensor of every shard is listed, and listed for that shard (no tensor twice).
    for (const auto& [shard, file] : shards)
      for (const SafetensorsEntry& e : file->tensors()) {
        auto it = weight_map.find(e.name);
        if (it == weight_map.end())
          throw Error(ErrorCode::kCorrupt, index_path + ": tensor `" + e.name + "` of shard `" +
                                               shard + "` is not listed in weight_map");
        if (it->second != shard)
          throw Error(ErrorCode::kCorrupt,
                      index_path + ": tensor `" + e.name + "` appears in shard `" + shard +
                          "` too, but weight_map assigns it to `" + it->second + "`");
      }
  } else if (IsFile(single_path)) {
    f.files_.push_back(std::make_unique<SafetensorsFile>(SafetensorsFile::Open(single_path)));
    for (const SafetensorsEntry& e : f.files_.back()->tensors())
      f.by_name_[e.name] = Ref{f.files_.back().get(), &e};
  } else {
    // Say what the folder holds instead: a PyTorch pickle checkpoint is the usual case, and
    // converting it is one call.
    std::string found;
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
      const std::string name = entry.path().filename().string();
      const std::string ext = entry.path().extension().string();
      if (ext == ".bin" || ext == ".pt" || ext == ".pth" || ext == ".ckpt" || ext == ".gguf" ||
          ext == ".safetensors" || name == "pytorch_model.bin.index.json")
        found += (found.empty() ? "" : ", ") + name;
    }
    throw Error(ErrorCode::kNotFound,
                dir + ": neither " + stem + ".safetensors nor " + stem + ".safetensors.index.json" +
                    (found.empty() ? std::string(" (and no other weights file)")
                                   : "; found " + found +
                                         ": lorastream reads safetensors only; convert with "
                                         "transformers: AutoModelForCausalLM.from_pretrained(DIR)"
                                         ".save_pretrained(DIR, safe_serialization=True)"));
  }
  return f;
}

std::vector<SafetensorsFolder::Ref> SafetensorsFolder::AllTensors() const {
  std::vector<Ref> all;
  for (const auto& file : files_)
    for (const SafetensorsEntry& e : file->tensors()) all.push_back(Ref{file.get(), &e});
  return all;
}

SafetensorsFolder::Ref SafetensorsFolder::Get(const std::string& name) const {
  auto it = by_name_.find(name);
  if (it == by_name_.end())
    throw Error(ErrorCode::kNotFound, dir_ + ": checkpoint has no tensor `" + name + "`");
  return it->second;
}

bool SafetensorsFolder::Has(const std::string& name) const { return by_name_.count(name) != 0; }

Checkpoint Checkpoint::Open(const std::string& dir_in) {
  std::string dir = dir_in;
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  if (!IsDir(dir)) throw Error(ErrorCode::kNotFound, dir + ": not a folder");
  Checkpoint cp;
  cp.dir_ = dir;
  const std::string config_path = dir + "/config.json";
  if (!IsFile(config_path))
    throw Error(ErrorCode::kNotFound, dir + ": no config.json (not a Hugging Face checkpoint)");
  cp.config_ = LoadModelConfig(config_path);
  cp.tensors_ = SafetensorsFolder::Open(dir, "model");
  return cp;
}

std::vector<Checkpoint::Ref> Checkpoint::AllTensors() const { return tensors_.AllTensors(); }

Checkpoint::Ref Checkpoint::Get(const std::string& name) const { return tensors_.Get(name); }

bool Checkpoint::Has(const std::string& name) const { return tensors_.Has(name); }

}  // namespace lorastream
