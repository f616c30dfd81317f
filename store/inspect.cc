#include "store/inspect.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstdio>

#include "common/base/error.h"
#include "common/base/format_bytes.h"
#include "common/formats/safetensors.h"
#include "store/dit_pack.h"
#include "store/layout.h"

namespace lorastream::store {

namespace {

void ListFile(const SafetensorsFile& file, std::ostream& out, uint64_t* total, size_t* count) {
  out << file.path() << ": " << file.tensors().size() << " tensors";
  for (const auto& [k, v] : file.header().metadata) out << ", " << k << "=" << v;
  out << "\n";
  for (const SafetensorsEntry& e : file.tensors()) {
    char line[64];
    std::snprintf(line, sizeof(line), "  %-8s %14llu  ", DTypeName(e.dtype),
                  static_cast<unsigned long long>(e.nbytes()));
    out << line << e.name << " " << ShapeString(e.shape) << "\n";
    *total += e.nbytes();
  }
  *count += file.tensors().size();
}

// A .safetensors file in BFL's FLUX naming (other files are listed as they are).
bool IsFluxSafetensors(const std::string& path) {
  try {
    return DetectFluxCheckpoint(path) == FluxCheckpointKind::kBflFile;
  } catch (const Error&) {
    return false;
  }
}

// The files a plan reads, in the order it first reads them.
std::vector<const SafetensorsFile*> SourceFiles(const PackPlan& plan) {
  std::vector<const SafetensorsFile*> files;
  auto add = [&](const Checkpoint::Ref& ref) {
    if (ref.file != nullptr && std::find(files.begin(), files.end(), ref.file) == files.end())
      files.push_back(ref.file);
  };
  for (const auto& block : plan.block_sources)
    for (const Checkpoint::Ref& ref : block) add(ref);
  for (const Checkpoint::Ref& ref : plan.rest_sources) add(ref);
  for (const PackPlan::Quantize& q : plan.quantize)
    for (const Checkpoint::Ref& ref : q.sources) add(ref);
  return files;
}

}  // namespace

void RunInspect(const std::string& path, std::ostream& out) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0)
    throw Error(ErrorCode::kNotFound, path + ": no such file or folder");
  uint64_t total = 0;
  size_t count = 0;
  const bool folder = S_ISDIR(st.st_mode);
  const bool qwen_image = IsQwenImageCheckpointPath(path);
  const bool flux = !qwen_image && (folder ? IsFluxCheckpointPath(path) : IsFluxSafetensors(path));
  if (flux || qwen_image) {
    // The store's own checks (the family's shape, every tensor; one dtype).
    const DitPackPlan plan =
        flux ? PlanFluxPack(path, PackOptions{}) : PlanQwenImagePack(path, PackOptions{});
    const std::vector<const SafetensorsFile*> files = SourceFiles(plan.load);
    for (const SafetensorsFile* f : files) ListFile(*f, out, &total, &count);
    const Manifest& m = plan.layout;
    if (flux) {
      const FluxConfig& c = m.flux;
      out << "FLUX.1 (" << (folder ? "diffusers folder" : "BFL file") << "): " << c.depth
          << " double + " << c.depth_single << " single blocks, hidden " << c.hidden_size
          << ", heads " << c.num_heads << ", guidance " << (c.guidance_embed ? "embedded" : "none")
          << "; a store packs " << m.blocks.size() << " units of up to "
          << kFluxDefaultSinglesPerUnit << " single blocks";
    } else {
      const QwenImageConfig& c = m.qwen_image;
      out << "Qwen-Image (" << (folder ? "diffusers folder" : "single file")
          << "): " << c.num_layers << " blocks, hidden " << c.hidden() << ", heads " << c.num_heads
          << ", text " << c.joint_attention_dim << "; a store packs " << m.blocks.size()
          << " units of one block (" << FormatBytes(m.blocks.front().nbytes) << " each)";
    }
    out << (m.quant().compressed() ? ", block linears pre-quantised " + DescribeQuant(m.quant())
                                   : "")
        << "; every tensor matches it\n";
    out << "total: " << files.size() << " file(s), ";
  } else if (S_ISDIR(st.st_mode)) {
    Checkpoint cp = Checkpoint::Open(path);
    const ModelConfig& c = cp.config();
    std::vector<const SafetensorsFile*> files;
    for (const Checkpoint::Ref& ref : cp.AllTensors())
      if (files.empty() || files.back() != ref.file) files.push_back(ref.file);
    for (const SafetensorsFile* f : files) ListFile(*f, out, &total, &count);
    const PackPlan plan =
        PlanPack(cp, PackOptions{});  // the store's own checks against config.json
    out << "config: " << c.model_type << ", " << c.num_hidden_layers << " layers, hidden "
        << c.hidden_size << ", intermediate " << c.intermediate_size
        << (c.is_moe() ? ", " + std::to_string(c.num_experts) + " experts of intermediate " +
                             std::to_string(c.moe_intermediate_size) + " (" +
                             std::to_string(c.num_experts_per_tok) + " per token" +
                             (c.norm_topk_prob ? ", weights renormalised" : "") +
                             "; a block's segment holds its router and every expert)"
                       : "")
        << ", heads " << c.num_attention_heads << "/" << c.num_key_value_heads << " (head_dim "
        << c.head_dim << "), vocab " << c.vocab_size
        << (c.tie_word_embeddings ? ", tied embeddings" : "")
        << (c.checkpoint_quant.compressed()
                ? ", projections pre-quantised " + DescribeQuant(plan.manifest.quant())
                : "")
        << "; every tensor matches it\n";
    out << "total: " << files.size() << " file(s), ";
  } else if (S_ISREG(st.st_mode)) {
    SafetensorsFile file = SafetensorsFile::Open(path);
    ListFile(file, out, &total, &count);
    out << "total: ";
  } else {
    throw Error(ErrorCode::kInvalidArgument, path + ": neither a file nor a folder");
  }
  out << count << " tensors, " << total << " bytes (" << FormatBytes(total, 2) << ")\n";
}

}  // namespace lorastream::store
