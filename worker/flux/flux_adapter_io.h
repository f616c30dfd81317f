// A FLUX adapter in the two formats its users load:
//   kohya (sd-scripts; ComfyUI, Forge, sd-scripts itself): per BFL module
//     lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight  A [r, in]
//     lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight    B [out, r]
//     lora_unet_double_blocks_0_img_attn_qkv.alpha             alpha (a scalar)
//   diffusers/peft (FluxPipeline.load_lora_weights): per diffusers module
//     transformer.transformer_blocks.0.attn.to_q.lora_A.weight / .lora_B.weight
//     fused BFL projections split by rows (qkv -> to_q, to_k, to_v; linear1 -> to_q, to_k,
//     to_v, proj_mlp), each part with the whole A. diffusers reads such a file with
//     lora_alpha = r, so B is saved multiplied by alpha / r: the same update.
// Both in f32.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <c10/core/Device.h>

#include "common/formats/flux_config.h"
#include "common/job/flux_job.h"
#include "worker/flux/flux_model.h"
#include "worker/model/dit_adapter_io.h"

namespace lorastream::worker::flux {

void SaveKohyaAdapter(const FluxAdapter& adapter, const std::string& path);
void SaveDiffusersAdapter(const FluxAdapter& adapter, const FluxConfig& config,
                          const std::string& path);
// A kohya file's weights into `adapter` (same modules and rank; alpha must match): resume and
// tests. Errors name the file and the tensor.
void LoadKohyaAdapter(const std::string& path, FluxAdapter& adapter);

// What a kohya file holds, read from its keys and shapes: the block-relative modules it adapts
// (in FluxDoubleLinears / FluxSingleLinears order; every block of a kind must carry the same
// ones), its rank (lora_down's rows) and alpha. Refuses (kCorrupt / kUnsupported, naming the
// file and the key) a key of no module of `config`, a module without its three tensors, ranks
// or alphas that differ between modules.
using KohyaAdapterInfo = dit::DownUpAdapterInfo;
KohyaAdapterInfo ReadKohyaAdapterInfo(const std::string& path, const FluxConfig& config);
// A kohya file as an adapter (f32 on `device`): ReadKohyaAdapterInfo, then LoadKohyaAdapter.
// `path` may be the folder holding adapter_kohya.safetensors (a FLUX job's output_dir).
FluxAdapter ReadKohyaAdapter(const std::string& path, const FluxConfig& config, c10::Device device);
// The kohya file `path` names: itself, or DIR/adapter_kohya.safetensors for a folder.
std::string KohyaAdapterFile(const std::string& path);

// flux.init_from (common/job/flux_job.h): what the job leaves to the file (rank 0, alpha 0, no
// targets) taken from it, and rank, alpha and targets the job sets refused (kRefused) when
// they differ, each naming the key, both values and the file. A no-op without init_from;
// idempotent. The trainer calls it before it plans or builds the job's adapter.
void ApplyFluxInitFrom(FluxJob& job, const FluxConfig& config);
// The weights of the file flux.init_from names into the job's fresh adapter (LoadKohyaAdapter).
void LoadFluxInitFrom(const FluxJob& job, FluxAdapter& adapter);

}  // namespace lorastream::worker::flux
