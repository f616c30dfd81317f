// ComfyUI loads every tensor of our FLUX kohya file (adapter_kohya.safetensors): its key rules
// encoded here as data, faithfully, from ComfyUI's comfy/lora.py (comfyanonymous/ComfyUI,
// commit 41444b5236c613ee5ff7d09aa620f94b702f30eb):
//   model_lora_keys_unet(model): for every key k of the model's state dict that starts with
//     "diffusion_model." and ends with ".weight", with s = k without both and '.' -> '_':
//     key_map["lora_unet_" + s] = k, key_map["lora_prior_unet_" + s] = k, and
//     key_map[k without ".weight"] = k; a key not ending in ".weight": key_map[k] = k. (Its
//     diffusers and lycoris names for Flux are other formats, not ours.) ComfyUI's Flux model
//     (comfy/ldm/flux) holds BFL's names under "diffusion_model.".
//   load_lora(lora, key_map): for each x of key_map: x + ".alpha" is loaded when present;
//     when x + ".lora_up.weight" is present it and x + ".lora_down.weight" are loaded, and the
//     weight key_map[x] is patched with up @ down * alpha / rank. Every key of the file not
//     loaded is logged "lora key not loaded" and ignored.
#include "torch_catch.h"  // first: see there

#include <c10/core/GradMode.h>

#include <filesystem>
#include <map>
#include <set>
#include <string>

#include "common/formats/flux_config.h"
#include "common/formats/safetensors.h"
#include "tests/support/flux_checkpoint.h"
#include "worker/flux/flux_adapter_io.h"
#include "worker/flux/flux_model.h"
#include "worker_test_util.h"

using namespace lorastream;
using namespace lorastream::worker::flux;

namespace {

// ComfyUI's key_map for a model whose state dict is `state_dict` (model_lora_keys_unet).
std::map<std::string, std::string> ComfyUnetKeyMap(const std::vector<std::string>& state_dict) {
  const std::string prefix = "diffusion_model.", weight = ".weight";
  std::map<std::string, std::string> key_map;
  for (const std::string& k : state_dict) {
    if (k.compare(0, prefix.size(), prefix) != 0) continue;
    const bool is_weight =
        k.size() > weight.size() && k.compare(k.size() - weight.size(), weight.size(), weight) == 0;
    if (!is_weight) {
      key_map[k] = k;
      continue;
    }
    std::string s = k.substr(prefix.size(), k.size() - prefix.size() - weight.size());
    const std::string generic = k.substr(0, k.size() - weight.size());
    for (char& c : s)
      if (c == '.') c = '_';
    key_map["lora_unet_" + s] = k;
    key_map["lora_prior_unet_" + s] = k;
    key_map[generic] = k;
  }
  return key_map;
}

}  // namespace

TEST_CASE("ComfyUI's LoRA loader maps every key of our FLUX kohya file to a model weight",
          "[worker][flux][consumers]") {
  testing::TempDir dir("comfyui-keys");
  const std::string model = testing::MakeFluxCheckpoint(dir / "model");
  const SafetensorsFile base = SafetensorsFile::Open(model);
  const FluxConfig config = FluxConfigFromHeader(base.header(), model);
  std::vector<std::string> state_dict;
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const SafetensorsEntry& e : base.tensors()) {
    state_dict.push_back("diffusion_model." + e.name);
    shapes["diffusion_model." + e.name] = e.shape;
  }
  const auto key_map = ComfyUnetKeyMap(state_dict);

  for (const char* targets : {"all", "attention"}) {
    DYNAMIC_SECTION(targets) {
      FluxAdapter adapter(config, FluxTargets({targets}, "test"), 4, 8.0, 1, at::kCPU);
      const std::string file = dir / (std::string("adapter-") + targets + ".safetensors");
      SaveKohyaAdapter(adapter, file);
      const SafetensorsFile lora = SafetensorsFile::Open(file);

      // load_lora
      std::set<std::string> loaded;
      std::map<std::string, std::string> patched;  // weight -> the LoRA stem that patches it
      for (const auto& [x, weight] : key_map) {
        if (lora.Find(x + ".alpha")) loaded.insert(x + ".alpha");
        if (lora.Find(x + ".lora_up.weight")) {
          const SafetensorsEntry* down = lora.Find(x + ".lora_down.weight");
          REQUIRE(down != nullptr);  // ComfyUI reads it unconditionally
          loaded.insert(x + ".lora_up.weight");
          loaded.insert(x + ".lora_down.weight");
          patched[weight] = x;
          // up [out, r] @ down [r, in] must be the weight's shape.
          const SafetensorsEntry* up = lora.Find(x + ".lora_up.weight");
          INFO(x);
          CHECK(std::vector<int64_t>{up->shape[0], down->shape[1]} == shapes.at(weight));
          CHECK(up->shape[1] == down->shape[0]);
        }
      }
      for (const SafetensorsEntry& e : lora.tensors()) {
        INFO("lora key not loaded: " << e.name);
        CHECK(loaded.count(e.name) == 1);
      }
      // Every adapted module is one weight patched.
      CHECK(patched.size() == adapter.modules().size());
      for (const auto& [module, m] : adapter.modules())
        CHECK(patched.count("diffusion_model." + module + ".weight") == 1);
    }
  }
}
