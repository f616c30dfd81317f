#include "common/formats/flux_layout.h"

#include <nlohmann/json.hpp>

#include "common/base/error.h"

namespace lorastream {

namespace {

using Json = nlohmann::json;

[[noreturn]] void Bad(const std::string& source, const std::string& what) {
  throw Error(ErrorCode::kCorrupt, source + ": manifest " + what);
}

// A dimension or count of the FLUX shape, at most `max` (a manifest too large to be a model is
// refused before anything is laid out from it).
int64_t GetInt(const Json& j, const char* key, const std::string& source,
               int64_t max = int64_t{1} << 20) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_number_integer())
    Bad(source, std::string("`flux.") + key + "` is missing or not an integer");
  const int64_t v = it->get<int64_t>();
  if (v < 0 || v > max) Bad(source, std::string("`flux.") + key + "` is out of range");
  return v;
}

constexpr int64_t kMaxFluxDepth = 4096;  // blocks of a kind (FLUX.1: 19 and 38)

}  // namespace

Manifest FluxManifest(const FluxConfig& c, int64_t singles_per_unit, DType dtype,
                      uint64_t alignment, const QuantInfo& linears) {
  Manifest m;
  m.config.model_type = kFluxModelType;
  m.flux = c;
  m.flux_singles_per_unit = singles_per_unit;
  m.dtype = dtype;
  m.alignment = alignment;
  for (const FluxUnit& unit : FluxUnits(c, singles_per_unit))
    m.blocks.push_back(LayoutSegment(FluxUnitShapes(c, unit), "", dtype, alignment, linears));
  m.rest = LayoutSegment(FluxRestShapes(c), "", dtype, alignment);
  m.config.num_hidden_layers = static_cast<int64_t>(m.blocks.size());
  return m;
}

void FluxManifestToJson(Json& out, const Manifest& m) {
  const FluxConfig& c = m.flux;
  out = Json{{"hidden_size", c.hidden_size},
             {"num_heads", c.num_heads},
             {"depth", c.depth},
             {"depth_single", c.depth_single},
             {"mlp_hidden", c.mlp_hidden},
             {"in_channels", c.in_channels},
             {"vec_in_dim", c.vec_in_dim},
             {"context_in_dim", c.context_in_dim},
             {"axes_dim", c.axes_dim},
             {"theta", c.theta},
             {"guidance_embed", c.guidance_embed},
             {"singles_per_unit", m.flux_singles_per_unit}};
}

void FluxManifestFromJson(const Json& j, Manifest& m, const std::string& source) {
  if (!j.is_object()) Bad(source, "`flux` must be an object");
  FluxConfig c;
  c.hidden_size = GetInt(j, "hidden_size", source);
  c.num_heads = GetInt(j, "num_heads", source);
  c.depth = GetInt(j, "depth", source, kMaxFluxDepth);
  c.depth_single = GetInt(j, "depth_single", source, kMaxFluxDepth);
  c.mlp_hidden = GetInt(j, "mlp_hidden", source);
  c.in_channels = GetInt(j, "in_channels", source);
  c.vec_in_dim = GetInt(j, "vec_in_dim", source);
  c.context_in_dim = GetInt(j, "context_in_dim", source);
  auto axes = j.find("axes_dim");
  if (axes == j.end() || !axes->is_array() || axes->size() != 3)
    Bad(source, "`flux.axes_dim` must be an array of three integers");
  for (size_t i = 0; i < 3; ++i) {
    if (!(*axes)[i].is_number_integer()) Bad(source, "`flux.axes_dim` must hold integers");
    c.axes_dim[i] = (*axes)[i].get<int64_t>();
  }
  auto theta = j.find("theta");
  if (theta == j.end() || !theta->is_number() || !(theta->get<double>() > 0))
    Bad(source, "`flux.theta` must be a positive number");
  c.theta = theta->get<double>();
  auto guidance = j.find("guidance_embed");
  if (guidance == j.end() || !guidance->is_boolean())
    Bad(source, "`flux.guidance_embed` must be true or false");
  c.guidance_embed = guidance->get<bool>();
  c.Validate(source + " (flux)");
  const int64_t singles = GetInt(j, "singles_per_unit", source, kMaxFluxDepth);
  if (singles < 1) Bad(source, "`flux.singles_per_unit` must be at least 1");
  m.flux = c;
  m.flux_singles_per_unit = singles;
  m.config = ModelConfig{};
  m.config.model_type = kFluxModelType;
  m.config.num_hidden_layers = static_cast<int64_t>(FluxUnits(c, singles).size());
}

FluxCheckpointReader FluxCheckpointReader::Open(const std::string& path) {
  FluxCheckpointReader r;
  r.path_ = path;
  if (DetectFluxCheckpoint(path) == FluxCheckpointKind::kBflFile) {
    r.file_.emplace(SafetensorsFile::Open(path));
    r.config_ = FluxConfigFromHeader(r.file_->header(), path);
    return r;
  }
  r.diffusers_.emplace(FluxDiffusersFolder::Open(path));
  r.config_ = r.diffusers_->config();
  for (auto& part : FluxDiffusersParts(r.config_)) r.parts_[part.bfl].push_back(std::move(part));
  return r;
}

std::vector<FluxCheckpointReader::Piece> FluxCheckpointReader::Pieces(
    const std::string& name) const {
  if (file_) {
    const SafetensorsEntry* e = file_->Find(name);
    LS_CHECK(e != nullptr, "validated FLUX file lacks " + name);
    const int64_t rows = e->shape.empty() ? 1 : e->shape[0];
    return {Piece{&*file_, e, 0, 0, rows}};
  }
  auto it = parts_.find(name);
  LS_CHECK(it != parts_.end(), "validated FLUX folder lacks " + name);
  std::vector<Piece> out;
  for (const FluxDiffusersPart& p : it->second) {
    const SafetensorsFolder::Ref ref = diffusers_->Get(p.diffusers);
    out.push_back(Piece{ref.file, ref.entry, p.diffusers_row, p.bfl_row, p.rows});
  }
  return out;
}

}  // namespace lorastream
