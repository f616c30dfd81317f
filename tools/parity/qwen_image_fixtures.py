#!/usr/bin/env python3
"""Qwen-Image parity fixtures from diffusers' QwenImageTransformer2DModel with peft LoRA.

Writes, per small random Qwen-Image config, into OUT/:
  NAME_model.safetensors  the transformer's weights under diffusers' names, as ComfyUI's
                          single file holds them (qi_l2: bare names; qi_l3m: every name
                          prefixed with "diffusion_model."), with the config in the metadata
                          (qwen_image.axes_dim, qwen_image.num_heads)
  NAME_case.safetensors   the inputs (img [B, N, 64] packed latents, txt [B, L, joint_dim],
                          txt_mask [B, L] as 0/1 floats, timesteps [B] in [0, 1], target),
                          the latent grid (grid = [latent_h / 2, latent_w / 2]), the LoRA
                          weights per module (MODULE.lora_A / .lora_B, diffusers' module names),
                          diffusers' output, the MSE loss and every LoRA gradient
                          (MODULE.grad_A / .grad_B)
  NAME_peft.safetensors   peft's state dict with diffusers' "transformer." prefix (what
                          QwenImagePipeline.load_lora_weights reads)
  qwen_image_fixtures.json  versions and a summary per case (written last)
All in f32 on the CPU. lorastream's tests/worker/qwen_image_test.cc compares, from
tests/fixtures/qwen_image/ (commit the folder).

qi_l2: 2 blocks, musubi-tuner's default LoRA targets (every Linear of a block but img_mod /
txt_mod), one text length, no mask (as musubi trains batch 1 and as the pipeline runs).
qi_l3m: 3 blocks, every Linear of a block adapted (the modulations too), the second caption
shorter: padded, with encoder_hidden_states_mask (as musubi batches captions of several
lengths). Latent grids of odd halves (3 x 5 tokens) so that the centred RoPE positions'
asymmetry shows.

Usage (diffusers v0.39.0's src/ on PYTHONPATH, torch, peft, safetensors installed):
  PYTHONPATH=.diffusers/src python3 tools/parity/qwen_image_fixtures.py --out tests/fixtures/qwen_image
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

from diffusers import QwenImageTransformer2DModel

RANK, ALPHA = 4, 8.0

COMMON = dict(patch_size=2, in_channels=64, out_channels=16, attention_head_dim=16,
              num_attention_heads=2, joint_attention_dim=24, axes_dims_rope=(4, 6, 6))

ATTENTION = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
             "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out"]
MLP = ["img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2"]
MOD = ["img_mod.1", "txt_mod.1"]

CASES = {
    "qi_l2": dict(layers=2, modules=ATTENTION + MLP, prefix="", lengths=(7, 7)),
    "qi_l3m": dict(layers=3, modules=ATTENTION + MLP + MOD, prefix="diffusion_model.",
                   lengths=(7, 4)),
}


def make_case(name, spec, out_dir, seed):
    torch.manual_seed(seed)
    model = QwenImageTransformer2DModel(num_layers=spec["layers"], **COMMON).to(torch.float32)
    with torch.no_grad():  # norms away from 1 so that a mixed-up scale shows
        for n, p in model.named_parameters():
            if "norm" in n and n.endswith("weight"):
                p.add_(0.1 * torch.randn_like(p))
    sd = {spec["prefix"] + k: v.detach().contiguous().clone()
          for k, v in model.state_dict().items()}
    axes = ",".join(str(a) for a in COMMON["axes_dims_rope"])
    save_file(sd, os.path.join(out_dir, f"{name}_model.safetensors"),
              metadata={"format": "pt", "qwen_image.axes_dim": axes,
                        "qwen_image.num_heads": str(COMMON["num_attention_heads"])})

    targets = [f"transformer_blocks.{i}.{m}" for i in range(spec["layers"])
               for m in spec["modules"]]
    model.add_adapter(LoraConfig(r=RANK, lora_alpha=ALPHA, init_lora_weights=True,
                                 target_modules=targets))
    case = {}
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for module in targets:
            sub = model.get_submodule(module)
            in_dim = sub.base_layer.weight.shape[1]
            out_dim = sub.base_layer.weight.shape[0]
            a = torch.randn(RANK, in_dim, generator=g) / in_dim ** 0.5
            b = torch.randn(out_dim, RANK, generator=g) * 0.05
            case[module + ".lora_A"] = a
            case[module + ".lora_B"] = b
            sub.lora_A["default"].weight.copy_(a)
            sub.lora_B["default"].weight.copy_(b)

    bsz, lh, lw = 2, 6, 10
    lt = max(spec["lengths"])
    n = (lh // 2) * (lw // 2)
    latents = torch.randn(bsz, 16, lh, lw, generator=g)
    # the pipeline's _pack_latents: [B, C, H, W] -> [B, (H/2)(W/2), 4C]
    img = latents.view(bsz, 16, lh // 2, 2, lw // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(
        bsz, n, 64)
    txt = torch.randn(bsz, lt, COMMON["joint_attention_dim"], generator=g)
    mask = torch.zeros(bsz, lt, dtype=torch.bool)
    for i, length in enumerate(spec["lengths"]):
        mask[i, :length] = True
        txt[i, length:] = 0  # padding, as musubi pads
    use_mask = len(set(spec["lengths"])) > 1
    timesteps = torch.tensor([0.3, 0.8])
    target = torch.randn(bsz, n, 64, generator=g)

    model.train()
    pred = model(hidden_states=img, encoder_hidden_states=txt,
                 encoder_hidden_states_mask=mask if use_mask else None, timestep=timesteps,
                 img_shapes=[(1, lh // 2, lw // 2)] * bsz, return_dict=False)[0]
    loss = torch.nn.functional.mse_loss(pred.float(), target.float())
    loss.backward()
    for module in targets:
        sub = model.get_submodule(module)
        for part, key in (("lora_A", ".grad_A"), ("lora_B", ".grad_B")):
            weight = getattr(sub, part)["default"].weight
            # the last block's text-only modules (txt_mlp, to_add_out) reach no output: no grad
            case[module + key] = weight.grad if weight.grad is not None else torch.zeros_like(weight)
    case.update({
        "img": img, "txt": txt, "txt_mask": mask.float(), "timesteps": timesteps,
        "target": target, "grid": torch.tensor([lh // 2, lw // 2], dtype=torch.float32),
        "use_mask": torch.tensor([1.0 if use_mask else 0.0]),
        "output": pred.detach(), "loss": loss.detach().reshape(1),
    })
    case = {k: v.detach().float().contiguous().clone() for k, v in case.items()}
    save_file(case, os.path.join(out_dir, f"{name}_case.safetensors"),
              metadata={"rank": str(RANK), "alpha": str(ALPHA)})
    peft_sd = get_peft_model_state_dict(model)
    peft_sd = {"transformer." + k: v.detach().float().contiguous().clone()
               for k, v in peft_sd.items()}
    save_file(peft_sd, os.path.join(out_dir, f"{name}_peft.safetensors"))
    return {"name": name, "loss": float(loss), "tensors": len(case), "peft_keys": len(peft_sd),
            "output_abs_max": float(pred.abs().max()), "masked": use_mask}


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
    for i, (name, spec) in enumerate(CASES.items()):
        try:
            report["cases"].append(make_case(name, spec, args.out, seed=200 + i))
        except Exception:  # keep the other case's fixtures; the report says what failed
            report["cases"].append({"name": name, "error": traceback.format_exc()})
            status = 1
    with open(os.path.join(args.out, "qwen_image_fixtures.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report, indent=1))
    return status


if __name__ == "__main__":
    sys.exit(main())
