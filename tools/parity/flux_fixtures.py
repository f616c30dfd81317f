#!/usr/bin/env python3
"""FLUX parity fixtures from diffusers' FluxTransformer2DModel with peft LoRA.

Writes, per small random FLUX config, into OUT/:
  NAME_model.safetensors  the transformer's weights in BFL's single-file naming (what
                          lorastream reads), converted from the diffusers model used here,
                          with the RoPE axes in the metadata (flux.axes_dim)
  NAME_case.safetensors   the inputs (img, txt, img_ids, txt_ids, y, timesteps, guidance,
                          target), the LoRA weights per BFL module (MODULE.lora_A/.lora_B),
                          diffusers' output, the MSE loss and every LoRA gradient folded into
                          BFL's modules (MODULE.grad_A: summed over the parts sharing A;
                          MODULE.grad_B: the parts' rows stacked)
  NAME_peft.safetensors   peft's state dict with diffusers' "transformer." prefix (what
                          FluxPipeline.load_lora_weights reads)
  flux_fixtures.json      versions and a summary per case (written last; the C++ test
                          looks for it)
All in f32 on the CPU (no TF32). lorastream's tests/worker/flux_parity_test.cc compares, from
tests/fixtures/flux/ (commit the folder).

Every name and conversion here follows diffusers v0.39.0: FluxTransformer2DModel's modules
(models/transformers/transformer_flux.py) and the BFL naming of
convert_flux_transformer_checkpoint_to_diffusers (loaders/single_file_utils.py), inverted:
fused qkv = cat(to_q, to_k, to_v) (add_*_proj for the text stream), linear1 = cat(to_q, to_k,
to_v, proj_mlp), norm_out's (scale, shift) halves swapped back to (shift, scale). That
converter itself cannot run on these tiny shapes (it hard-codes inner_dim 3072).

Usage (diffusers v0.39.0's src/ on PYTHONPATH, torch, peft, safetensors installed):
  PYTHONPATH=.diffusers/src python3 tools/parity/flux_fixtures.py --out tests/fixtures/flux
"""
import argparse
import json
import os
import sys
import traceback

import torch
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict
from safetensors.torch import save_file

from diffusers import FluxTransformer2DModel

RANK, ALPHA = 4, 8.0

CONFIGS = {
    # one block of each kind
    "flux_d1s2": dict(num_layers=1, num_single_layers=2),
    # deeper, an odd number of single blocks (a unit of one single block when packed by two)
    "flux_d3s5": dict(num_layers=3, num_single_layers=5),
}
COMMON = dict(patch_size=1, in_channels=64, attention_head_dim=16, num_attention_heads=2,
              joint_attention_dim=24, pooled_projection_dim=16, guidance_embeds=True,
              axes_dims_rope=(4, 6, 6))


def bfl_from_diffusers(sd, num_layers, num_single):
    """diffusers' FluxTransformer2DModel state dict -> BFL's flux1-dev.safetensors naming."""
    out = {}

    def lin(dst, src):
        out[dst + ".weight"] = sd[src + ".weight"]
        out[dst + ".bias"] = sd[src + ".bias"]

    def cat(dst, srcs):
        out[dst + ".weight"] = torch.cat([sd[s + ".weight"] for s in srcs], 0)
        out[dst + ".bias"] = torch.cat([sd[s + ".bias"] for s in srcs], 0)

    lin("img_in", "x_embedder")
    lin("txt_in", "context_embedder")
    lin("time_in.in_layer", "time_text_embed.timestep_embedder.linear_1")
    lin("time_in.out_layer", "time_text_embed.timestep_embedder.linear_2")
    lin("guidance_in.in_layer", "time_text_embed.guidance_embedder.linear_1")
    lin("guidance_in.out_layer", "time_text_embed.guidance_embedder.linear_2")
    lin("vector_in.in_layer", "time_text_embed.text_embedder.linear_1")
    lin("vector_in.out_layer", "time_text_embed.text_embedder.linear_2")
    for i in range(num_layers):
        d, b = f"double_blocks.{i}.", f"transformer_blocks.{i}."
        lin(d + "img_mod.lin", b + "norm1.linear")
        lin(d + "txt_mod.lin", b + "norm1_context.linear")
        cat(d + "img_attn.qkv", [b + "attn.to_q", b + "attn.to_k", b + "attn.to_v"])
        cat(d + "txt_attn.qkv", [b + "attn.add_q_proj", b + "attn.add_k_proj", b + "attn.add_v_proj"])
        out[d + "img_attn.norm.query_norm.scale"] = sd[b + "attn.norm_q.weight"]
        out[d + "img_attn.norm.key_norm.scale"] = sd[b + "attn.norm_k.weight"]
        out[d + "txt_attn.norm.query_norm.scale"] = sd[b + "attn.norm_added_q.weight"]
        out[d + "txt_attn.norm.key_norm.scale"] = sd[b + "attn.norm_added_k.weight"]
        lin(d + "img_attn.proj", b + "attn.to_out.0")
        lin(d + "txt_attn.proj", b + "attn.to_add_out")
        lin(d + "img_mlp.0", b + "ff.net.0.proj")
        lin(d + "img_mlp.2", b + "ff.net.2")
        lin(d + "txt_mlp.0", b + "ff_context.net.0.proj")
        lin(d + "txt_mlp.2", b + "ff_context.net.2")
    for i in range(num_single):
        d, b = f"single_blocks.{i}.", f"single_transformer_blocks.{i}."
        cat(d + "linear1", [b + "attn.to_q", b + "attn.to_k", b + "attn.to_v", b + "proj_mlp"])
        lin(d + "linear2", b + "proj_out")
        out[d + "norm.query_norm.scale"] = sd[b + "attn.norm_q.weight"]
        out[d + "norm.key_norm.scale"] = sd[b + "attn.norm_k.weight"]
        lin(d + "modulation.lin", b + "norm.linear")
    # AdaLayerNormContinuous chunks (scale, shift); BFL's LastLayer (shift, scale).
    w, bias = sd["norm_out.linear.weight"], sd["norm_out.linear.bias"]
    h = w.shape[0] // 2
    out["final_layer.adaLN_modulation.1.weight"] = torch.cat([w[h:], w[:h]], 0)
    out["final_layer.adaLN_modulation.1.bias"] = torch.cat([bias[h:], bias[:h]], 0)
    lin("final_layer.linear", "proj_out")
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def lora_parts(num_layers, num_single, dim, mlp):
    """BFL module -> [(diffusers module, row_begin, row_end)], as common/formats/flux_config.cc maps."""
    parts = {}
    for i in range(num_layers):
        d, b = f"double_blocks.{i}.", f"transformer_blocks.{i}."
        parts[d + "img_mod.lin"] = [(b + "norm1.linear", 0, 6 * dim)]
        parts[d + "txt_mod.lin"] = [(b + "norm1_context.linear", 0, 6 * dim)]
        parts[d + "img_attn.qkv"] = [(b + "attn.to_q", 0, dim), (b + "attn.to_k", dim, 2 * dim),
                                     (b + "attn.to_v", 2 * dim, 3 * dim)]
        parts[d + "txt_attn.qkv"] = [(b + "attn.add_q_proj", 0, dim),
                                     (b + "attn.add_k_proj", dim, 2 * dim),
                                     (b + "attn.add_v_proj", 2 * dim, 3 * dim)]
        parts[d + "img_attn.proj"] = [(b + "attn.to_out.0", 0, dim)]
        parts[d + "txt_attn.proj"] = [(b + "attn.to_add_out", 0, dim)]
        parts[d + "img_mlp.0"] = [(b + "ff.net.0.proj", 0, mlp)]
        parts[d + "img_mlp.2"] = [(b + "ff.net.2", 0, dim)]
        parts[d + "txt_mlp.0"] = [(b + "ff_context.net.0.proj", 0, mlp)]
        parts[d + "txt_mlp.2"] = [(b + "ff_context.net.2", 0, dim)]
    for i in range(num_single):
        d, b = f"single_blocks.{i}.", f"single_transformer_blocks.{i}."
        parts[d + "linear1"] = [(b + "attn.to_q", 0, dim), (b + "attn.to_k", dim, 2 * dim),
                                (b + "attn.to_v", 2 * dim, 3 * dim),
                                (b + "proj_mlp", 3 * dim, 3 * dim + mlp)]
        parts[d + "linear2"] = [(b + "proj_out", 0, dim)]
        parts[d + "modulation.lin"] = [(b + "norm.linear", 0, 3 * dim)]
    return parts


def make_case(name, cfg, out_dir, seed):
    torch.manual_seed(seed)
    model = FluxTransformer2DModel(**COMMON, **cfg).to(torch.float32)
    dim = COMMON["attention_head_dim"] * COMMON["num_attention_heads"]
    mlp = 4 * dim
    with torch.no_grad():  # norms away from 1 so that a mixed-up scale shows
        for n, p in model.named_parameters():
            if "norm_q" in n or "norm_k" in n or "norm_added" in n:
                p.add_(0.1 * torch.randn_like(p))
    nl, ns = cfg["num_layers"], cfg["num_single_layers"]
    bfl = bfl_from_diffusers(model.state_dict(), nl, ns)
    axes = ",".join(str(a) for a in COMMON["axes_dims_rope"])
    save_file(bfl, os.path.join(out_dir, f"{name}_model.safetensors"),
              metadata={"format": "pt", "flux.axes_dim": axes, "flux.theta": "10000"})

    parts = lora_parts(nl, ns, dim, mlp)
    targets = sorted({p[0] for v in parts.values() for p in v})
    model.add_adapter(LoraConfig(r=RANK, lora_alpha=ALPHA, init_lora_weights=True,
                                 target_modules=targets))
    case = {}
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for module, plist in parts.items():
            in_dim = model.get_submodule(plist[0][0]).base_layer.weight.shape[1]
            out_dim = plist[-1][2]
            a = torch.randn(RANK, in_dim, generator=g) / in_dim ** 0.5
            b = torch.randn(out_dim, RANK, generator=g) * 0.05
            case[module + ".lora_A"] = a
            case[module + ".lora_B"] = b
            for (dname, r0, r1) in plist:
                sub = model.get_submodule(dname)
                sub.lora_A["default"].weight.copy_(a)
                sub.lora_B["default"].weight.copy_(b[r0:r1])

    bsz, lh, lw, lt = 2, 4, 6, 8
    n = (lh // 2) * (lw // 2)
    img = torch.randn(bsz, n, COMMON["in_channels"], generator=g)
    txt = torch.randn(bsz, lt, COMMON["joint_attention_dim"], generator=g)
    y = torch.randn(bsz, COMMON["pooled_projection_dim"], generator=g)
    img_ids = torch.zeros(lh // 2, lw // 2, 3)
    img_ids[..., 1] = torch.arange(lh // 2)[:, None]
    img_ids[..., 2] = torch.arange(lw // 2)[None, :]
    img_ids = img_ids.reshape(n, 3)
    txt_ids = torch.zeros(lt, 3)
    timesteps = torch.tensor([0.3, 0.8])
    guidance = torch.tensor([1.0, 3.5])
    target = torch.randn(bsz, n, COMMON["in_channels"], generator=g)

    model.train()
    pred = model(hidden_states=img, encoder_hidden_states=txt, pooled_projections=y,
                 timestep=timesteps, img_ids=img_ids, txt_ids=txt_ids, guidance=guidance,
                 return_dict=False)[0]
    loss = torch.nn.functional.mse_loss(pred.float(), target.float())
    loss.backward()

    for module, plist in parts.items():
        ga = None
        gb = []
        for (dname, r0, r1) in plist:
            sub = model.get_submodule(dname)
            a_grad = sub.lora_A["default"].weight.grad
            ga = a_grad.clone() if ga is None else ga + a_grad
            gb.append(sub.lora_B["default"].weight.grad)
        case[module + ".grad_A"] = ga
        case[module + ".grad_B"] = torch.cat(gb, 0)
    case.update({
        "img": img, "txt": txt, "y": y,
        "img_ids": img_ids.unsqueeze(0).expand(bsz, -1, -1),
        "txt_ids": txt_ids.unsqueeze(0).expand(bsz, -1, -1),
        "timesteps": timesteps, "guidance": guidance, "target": target,
        "output": pred.detach(), "loss": loss.detach().reshape(1),
    })
    case = {k: v.detach().float().contiguous().clone() for k, v in case.items()}
    save_file(case, os.path.join(out_dir, f"{name}_case.safetensors"),
              metadata={"rank": str(RANK), "alpha": str(ALPHA)})
    peft_sd = get_peft_model_state_dict(model)
    peft_sd = {"transformer." + k: v.detach().float().contiguous().clone() for k, v in peft_sd.items()}
    save_file(peft_sd, os.path.join(out_dir, f"{name}_peft.safetensors"))
    return {"name": name, "loss": float(loss), "tensors": len(case), "peft_keys": len(peft_sd),
            "output_abs_max": float(pred.abs().max())}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.set_num_threads(8)
    import diffusers
    import peft
    report = {"torch": torch.__version__, "diffusers": diffusers.__version__,
              "peft": peft.__version__, "cases": []}
    status = 0
    for i, (name, cfg) in enumerate(CONFIGS.items()):
        try:
            report["cases"].append(make_case(name, cfg, args.out, seed=100 + i))
        except Exception:  # keep the other case's fixtures; the report says what failed
            report["cases"].append({"name": name, "error": traceback.format_exc()})
            status = 1
    with open(os.path.join(args.out, "flux_fixtures.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report, indent=1))
    return status


if __name__ == "__main__":
    sys.exit(main())
