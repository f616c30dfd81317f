#include "common/formats/flux_diffusers.h"

#include <sys/stat.h>

#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "common/base/error.h"
#include "common/posix/regular_file.h"

namespace lorastream {

namespace {

bool IsFile(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// One BFL tensor that is one diffusers tensor, whole.
void Whole(std::vector<FluxDiffusersPart>& out, const std::string& bfl, const std::string& diff,
           int64_t rows) {
  out.push_back({bfl, diff, 0, 0, rows});
}

// A BFL linear layer (weight and bias) that is one diffusers layer.
void Linear(std::vector<FluxDiffusersPart>& out, const std::string& bfl, const std::string& diff,
            int64_t rows) {
  Whole(out, bfl + ".weight", diff + ".weight", rows);
  Whole(out, bfl + ".bias", diff + ".bias", rows);
}

// A fused BFL linear layer whose rows are the diffusers layers `parts` (name, rows) in order.
void Fused(std::vector<FluxDiffusersPart>& out, const std::string& bfl,
           const std::vector<std::pair<std::string, int64_t>>& parts) {
  for (const char* kind : {".weight", ".bias"}) {
    int64_t row = 0;
    for (const auto& [diff, rows] : parts) {
      out.push_back({bfl + kind, diff + kind, row, 0, rows});
      row += rows;
    }
  }
}

int64_t GetInt(const nlohmann::json& j, const std::string& key, int64_t fallback,
               const std::string& source) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  if (!it->is_number_integer() || it->get<int64_t>() < 0)
    throw Error(ErrorCode::kCorrupt, source + ": `" + key + "` is not a non-negative integer");
  return it->get<int64_t>();
}

}  // namespace

std::vector<FluxDiffusersPart> FluxDiffusersParts(const FluxConfig& c) {
  const int64_t h = c.hidden_size, m = c.mlp_hidden;
  std::vector<FluxDiffusersPart> out;
  const std::string emb = "time_text_embed.";
  Linear(out, "img_in", "x_embedder", h);
  Linear(out, "time_in.in_layer", emb + "timestep_embedder.linear_1", h);
  Linear(out, "time_in.out_layer", emb + "timestep_embedder.linear_2", h);
  Linear(out, "vector_in.in_layer", emb + "text_embedder.linear_1", h);
  Linear(out, "vector_in.out_layer", emb + "text_embedder.linear_2", h);
  if (c.guidance_embed) {
    Linear(out, "guidance_in.in_layer", emb + "guidance_embedder.linear_1", h);
    Linear(out, "guidance_in.out_layer", emb + "guidance_embedder.linear_2", h);
  }
  Linear(out, "txt_in", "context_embedder", h);
  Linear(out, "final_layer.linear", "proj_out", c.in_channels);
  // BFL's final modulation is [shift; scale], diffusers' norm_out [scale; shift].
  for (const char* kind : {".weight", ".bias"}) {
    const std::string bfl = std::string("final_layer.adaLN_modulation.1") + kind;
    const std::string diff = std::string("norm_out.linear") + kind;
    out.push_back({bfl, diff, 0, h, h});
    out.push_back({bfl, diff, h, 0, h});
  }
  // A double block's two streams: BFL's prefix and diffusers' names of its modules.
  struct Stream {
    const char *bfl, *mod, *q, *k, *v, *norm_q, *norm_k, *proj, *ff;
  };
  static const Stream kStreams[] = {
      {"img", "norm1.linear", "attn.to_q", "attn.to_k", "attn.to_v", "attn.norm_q.weight",
       "attn.norm_k.weight", "attn.to_out.0", "ff"},
      {"txt", "norm1_context.linear", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj",
       "attn.norm_added_q.weight", "attn.norm_added_k.weight", "attn.to_add_out", "ff_context"}};
  for (int64_t i = 0; i < c.depth; ++i) {
    const std::string d = "transformer_blocks." + std::to_string(i) + ".";
    for (const Stream& st : kStreams) {
      const std::string p = "double_blocks." + std::to_string(i) + "." + st.bfl;
      Linear(out, p + "_mod.lin", d + st.mod, 6 * h);
      Fused(out, p + "_attn.qkv", {{d + st.q, h}, {d + st.k, h}, {d + st.v, h}});
      Whole(out, p + "_attn.norm.query_norm.scale", d + st.norm_q, c.head_dim());
      Whole(out, p + "_attn.norm.key_norm.scale", d + st.norm_k, c.head_dim());
      Linear(out, p + "_attn.proj", d + st.proj, h);
      Linear(out, p + "_mlp.0", d + st.ff + ".net.0.proj", m);
      Linear(out, p + "_mlp.2", d + st.ff + ".net.2", h);
    }
  }
  for (int64_t i = 0; i < c.depth_single; ++i) {
    const std::string p = "single_blocks." + std::to_string(i) + ".";
    const std::string d = "single_transformer_blocks." + std::to_string(i) + ".";
    Fused(out, p + "linear1",
          {{d + "attn.to_q", h}, {d + "attn.to_k", h}, {d + "attn.to_v", h}, {d + "proj_mlp", m}});
    Linear(out, p + "linear2", d + "proj_out", h);
    Whole(out, p + "norm.query_norm.scale", d + "attn.norm_q.weight", c.head_dim());
    Whole(out, p + "norm.key_norm.scale", d + "attn.norm_k.weight", c.head_dim());
    Linear(out, p + "modulation.lin", d + "norm.linear", 3 * h);
  }
  return out;
}

TensorShapes FluxDiffusersShapes(const FluxConfig& c) {
  std::map<std::string, std::vector<int64_t>> bfl;
  for (auto& [name, shape] : FluxAllShapes(c)) bfl[name] = shape;
  TensorShapes out;
  std::map<std::string, size_t> index;
  for (const auto& p : FluxDiffusersParts(c)) {
    auto it = index.find(p.diffusers);
    if (it == index.end()) {
      std::vector<int64_t> shape = bfl.at(p.bfl);
      shape[0] = 0;
      it = index.emplace(p.diffusers, out.size()).first;
      out.push_back({p.diffusers, shape});
    }
    out[it->second].second[0] += p.rows;
  }
  return out;
}

std::string FluxDiffusersConfigJson(const FluxConfig& c) {
  if (c.theta != 10000.0 || c.mlp_hidden != 4 * c.hidden_size)
    throw Error(ErrorCode::kUnsupported,
                "diffusers' FluxTransformer2DModel has RoPE theta 10000 and an MLP of 4 x hidden; "
                "this shape has theta " +
                    std::to_string(c.theta) + " and MLP " + std::to_string(c.mlp_hidden));
  nlohmann::json j = {{"_class_name", "FluxTransformer2DModel"},
                      {"_diffusers_version", "0.39.0"},
                      {"patch_size", 1},
                      {"in_channels", c.in_channels},
                      {"out_channels", nullptr},
                      {"num_layers", c.depth},
                      {"num_single_layers", c.depth_single},
                      {"attention_head_dim", c.head_dim()},
                      {"num_attention_heads", c.num_heads},
                      {"joint_attention_dim", c.context_in_dim},
                      {"pooled_projection_dim", c.vec_in_dim},
                      {"guidance_embeds", c.guidance_embed},
                      {"axes_dims_rope", {c.axes_dim[0], c.axes_dim[1], c.axes_dim[2]}}};
  return j.dump(2) + "\n";
}

FluxDiffusersFolder FluxDiffusersFolder::Open(const std::string& path) {
  std::string dir = path;
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  if (IsFile(dir + "/transformer/config.json")) dir += "/transformer";
  const std::string config_path = dir + "/config.json";
  const nlohmann::json j =
      nlohmann::json::parse(ReadRegularFile(config_path, kMaxTextFileBytes, "config.json"), nullptr,
                            /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object())
    throw Error(ErrorCode::kCorrupt, config_path + ": not a JSON object");
  if (j.value("_class_name", "") != "FluxTransformer2DModel")
    throw Error(ErrorCode::kUnsupported,
                config_path + ": _class_name is not FluxTransformer2DModel");
  if (GetInt(j, "patch_size", 1, config_path) != 1)
    throw Error(ErrorCode::kUnsupported, config_path + ": patch_size other than 1 is not FLUX.1");
  FluxDiffusersFolder f;
  FluxConfig& c = f.config_;
  const int64_t head_dim = GetInt(j, "attention_head_dim", 128, config_path);
  c.num_heads = GetInt(j, "num_attention_heads", 24, config_path);
  c.hidden_size = c.num_heads * head_dim;
  c.mlp_hidden = 4 * c.hidden_size;  // FluxTransformerBlock's and FluxSingleTransformerBlock's
  c.depth = GetInt(j, "num_layers", 19, config_path);
  c.depth_single = GetInt(j, "num_single_layers", 38, config_path);
  c.in_channels = GetInt(j, "in_channels", 64, config_path);
  if (GetInt(j, "out_channels", c.in_channels, config_path) != c.in_channels)
    throw Error(ErrorCode::kUnsupported,
                config_path + ": out_channels differs from in_channels (not FLUX.1)");
  c.context_in_dim = GetInt(j, "joint_attention_dim", 4096, config_path);
  c.vec_in_dim = GetInt(j, "pooled_projection_dim", 768, config_path);
  auto g = j.find("guidance_embeds");
  c.guidance_embed = g != j.end() && g->is_boolean() && g->get<bool>();
  auto axes = j.find("axes_dims_rope");
  if (axes != j.end()) {
    if (!axes->is_array() || axes->size() != 3)
      throw Error(ErrorCode::kCorrupt, config_path + ": `axes_dims_rope` is not three integers");
    for (int i = 0; i < 3; ++i) {
      if (!(*axes)[i].is_number_integer())
        throw Error(ErrorCode::kCorrupt, config_path + ": `axes_dims_rope` is not three integers");
      c.axes_dim[i] = (*axes)[i].get<int64_t>();
    }
  }
  c.theta = 10000.0;  // FluxPosEmbed(theta=10000)
  c.Validate(config_path);

  f.tensors_ = SafetensorsFolder::Open(dir, "diffusion_pytorch_model");
  std::set<std::string> expected;
  for (const auto& [name, shape] : FluxDiffusersShapes(c)) {
    if (!f.tensors_.Has(name))
      throw Error(ErrorCode::kCorrupt, dir + ": missing tensor `" + name + "`");
    const auto& have = f.tensors_.Get(name).entry->shape;
    if (have != shape)
      throw Error(ErrorCode::kCorrupt, dir + ": tensor `" + name + "` has shape " +
                                           ShapeString(have) + ", expected " + ShapeString(shape) +
                                           " (from config.json)");
    expected.insert(name);
  }
  for (const auto& ref : f.tensors_.AllTensors())
    if (!expected.count(ref.entry->name))
      throw Error(ErrorCode::kCorrupt, dir + ": unexpected tensor `" + ref.entry->name +
                                           "` (not part of FluxTransformer2DModel of this "
                                           "config.json)");
  return f;
}

}  // namespace lorastream
