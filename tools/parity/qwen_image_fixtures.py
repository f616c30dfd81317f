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
  qwen_image_fixtures.json  versions and a summary per case (written last; with --only, the
                          cases run replace theirs in the file and the others stay)
An edit case (qie_*) is Qwen-Image-Edit's: its case file also holds the control images'
packed latents (control [B, Nc, 64], concatenated after img as QwenImageEditPipeline and
QwenImageEditPlusPipeline concatenate image_latents) and their grids (control_grids [K, 2]);
the transformer runs on cat([img, control], 1) with img_shapes [[(1, H, W), (1, Hc, Wc), ...]]
per sample, and output, loss and gradients are of the image's tokens alone
(noise_pred[:, :N], as the pipelines and musubi-tuner's trainer slice it).
All in f32 on the CPU. lorastream's tests/worker/qwen_image_test.cc compares, from
tests/fixtures/qwen_image/ (commit the folder).

qi_l2: 2 blocks, musubi-tuner's default LoRA targets (every Linear of a block but img_mod /
txt_mod), one text length, no mask (as musubi trains batch 1 and as the pipeline runs).
qi_l3m: 3 blocks, every Linear of a block adapted (the modulations too), the second caption
shorter: padded, with encoder_hidden_states_mask (as musubi batches captions of several
lengths). Latent grids of odd halves (3 x 5 tokens) so that the centred RoPE positions'
asymmetry shows.
qie_l2: Qwen-Image-Edit, qi_l2's settings, one control image of a larger grid (4 x 7: the
text's RoPE start moves to max(4/2, 7/2) = 3).
qie_l3m: Edit-2509's several control images (4 x 7 and 2 x 3) with qi_l3m's settings (every
Linear adapted, a padded, masked caption).

Usage (diffusers v0.39.0's src/ on PYTHONPATH, torch, peft, safetensors installed):
  PYTHONPATH=.diffusers/src python3 tools/parity/qwen_image_fixtures.py --out tests/fixtures/qwen_image
  (--only qie_l2,qie_l3m: those cases alone)
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
    "qie_l2": dict(layers=2, modules=ATTENTION + MLP, prefix="", lengths=(7, 7),
                   controls=[(8, 14)]),
    "qie_l3m": dict(layers=3, modules=ATTENTION + MLP + MOD, prefix="diffusion_model.",
                    lengths=(7, 4), controls=[(8, 14), (4, 6)]),
}


def pack(latents):
    """The pipeline's _pack_latents: [B, C, H, W] -> [B, (H/2)(W/2), 4C]."""
    bsz, c, h, w = latents.shape
    return latents.view(bsz, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(
        bsz, (h // 2) * (w // 2), 4 * c)


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
    img = pack(latents)
    txt = torch.randn(bsz, lt, COMMON["joint_attention_dim"], generator=g)
    mask = torch.zeros(bsz, lt, dtype=torch.bool)
    for i, length in enumerate(spec["lengths"]):
        mask[i, :length] = True
        txt[i, length:] = 0  # padding, as musubi pads
    use_mask = len(set(spec["lengths"])) > 1
    timesteps = torch.tensor([0.3, 0.8])
    target = torch.randn(bsz, n, 64, generator=g)

    # Qwen-Image-Edit: the control images' latents (clean) after the image's in the sequence,
    # each image's shape in img_shapes (control k at RoPE frame k + 1), the prediction sliced
    # to the image's tokens.
    controls = [pack(torch.randn(bsz, 16, ch, cw, generator=g))
                for ch, cw in spec.get("controls", [])]
    shapes = [(1, lh // 2, lw // 2)] + [(1, ch // 2, cw // 2) for ch, cw in spec.get("controls", [])]
    hidden = torch.cat([img] + controls, dim=1)

    model.train()
    pred = model(hidden_states=hidden, encoder_hidden_states=txt,
                 encoder_hidden_states_mask=mask if use_mask else None, timestep=timesteps,
                 img_shapes=[shapes] * bsz if controls else [shapes[0]] * bsz,
                 return_dict=False)[0]
    pred = pred[:, :n]
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
    if controls:
        case["control"] = torch.cat(controls, dim=1)
        case["control_grids"] = torch.tensor([[ch // 2, cw // 2] for ch, cw in spec["controls"]],
                                             dtype=torch.float32)
    case = {k: v.detach().float().contiguous().clone() for k, v in case.items()}
    save_file(case, os.path.join(out_dir, f"{name}_case.safetensors"),
              metadata={"rank": str(RANK), "alpha": str(ALPHA)})
    peft_sd = get_peft_model_state_dict(model)
    peft_sd = {"transformer." + k: v.detach().float().contiguous().clone()
               for k, v in peft_sd.items()}
    save_file(peft_sd, os.path.join(out_dir, f"{name}_peft.safetensors"))
    return {"name": name, "loss": float(loss), "tensors": len(case), "peft_keys": len(peft_sd),
            "output_abs_max": float(pred.abs().max()), "masked": use_mask,
            "controls": [list(c) for c in spec.get("controls", [])]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default="", help="comma-separated case names (default: every case)")
    args = ap.parse_args()
    only = [c for c in args.only.split(",") if c]
    unknown = [c for c in only if c not in CASES]
    if unknown:
        ap.error(f"--only: unknown case(s) {unknown}; the cases: {list(CASES)}")
    os.makedirs(args.out, exist_ok=True)
    torch.set_num_threads(8)
    import diffusers
    import peft
    versions = {"torch": torch.__version__, "diffusers": diffusers.__version__,
                "peft": peft.__version__}
    report_path = os.path.join(args.out, "qwen_image_fixtures.json")
    report = dict(versions, cases=[])
    if only and os.path.exists(report_path):  # keep the cases not run, each with its versions
        with open(report_path) as f:
            old = json.load(f)
        old_versions = {k: old.get(k) for k in versions}
        report["cases"] = [dict(c, **{k: c.get(k, old_versions[k]) for k in versions})
                           for c in old.get("cases", []) if c.get("name") not in only]
    status = 0
    for i, (name, spec) in enumerate(CASES.items()):
        if only and name not in only:
            continue
        try:
            report["cases"].append(dict(make_case(name, spec, args.out, seed=200 + i), **versions))
        except Exception:  # keep the other case's fixtures; the report says what failed
            report["cases"].append({"name": name, "error": traceback.format_exc()})
            status = 1
    with open(report_path, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report, indent=1))
    return status


if __name__ == "__main__":
    sys.exit(main())
