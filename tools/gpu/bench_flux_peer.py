#!/usr/bin/env python3
"""The diffusers + peft peer of tools/gpu/bench_flux.sh: FluxTransformer2DModel of a FLUX
preset's shape (configs/models/PRESET.toml) with random weights in bf16, peft LoRA of rank 16
on the same linear layers lorastream's `targets = ["all"]` adapts (every linear layer of the
blocks: attention, feed-forward, the single blocks' proj_mlp/proj_out and the modulations),
one image of PIXELS with TEXT_TOKENS T5 tokens, batch 1, AdamW; timed like lorastream's steps
(forward, MSE loss, backward, optimizer step; the device synchronised per step), the median of
the steps after two warm-up steps. Two configurations: gradient checkpointing on (like
lorastream's checkpointed units), and off under bf16 autocast (its fastest; more memory).

Usage (diffusers v0.39.0's src/ on PYTHONPATH, torch with CUDA, peft):
  PYTHONPATH=.diffusers/src python3 tools/gpu/bench_flux_peer.py --preset flux1-dev \
      --pixels 1024x1024 --text-tokens 512 --steps 6 --out peer.json
"""
import argparse
import json
import os

import torch
from peft import LoraConfig

from bench_common import lora_params_f32, time_steps  # this folder is on sys.path
from diffusers import FluxTransformer2DModel

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TARGETS = (r".*transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|"
           r"add_v_proj|to_add_out)|ff\.net\.0\.proj|ff\.net\.2|ff_context\.net\.0\.proj|"
           r"ff_context\.net\.2|proj_mlp|proj_out|norm1\.linear|norm1_context\.linear|norm\.linear)")


def preset(name):
    """The `key = value` lines of configs/models/NAME.toml (comments dropped)."""
    out = {}
    for line in open(os.path.join(ROOT, "configs", "models", name + ".toml")):
        line = line.split("#", 1)[0].strip()
        if "=" in line:
            k, v = (x.strip() for x in line.split("=", 1))
            out[k] = v.strip('"')
    return out


def model_config(p):
    hidden, heads = int(p["hidden_size"]), int(p["num_heads"])
    if int(p.get("mlp_hidden", 4 * hidden)) != 4 * hidden:
        raise SystemExit("diffusers' FLUX blocks have an MLP of 4 x hidden")
    return dict(patch_size=1, in_channels=int(p.get("in_channels", 64)),
                num_layers=int(p["depth"]), num_single_layers=int(p["depth_single"]),
                attention_head_dim=hidden // heads, num_attention_heads=heads,
                joint_attention_dim=int(p.get("context_in_dim", 4096)),
                pooled_projection_dim=int(p.get("vec_in_dim", 768)),
                guidance_embeds=p.get("guidance_embed", "true") == "true",
                axes_dims_rope=tuple(int(a) for a in p.get("axes_dim", "16,56,56").split(",")))


def run(cfg, args, checkpointing, autocast):
    device = torch.device(args.device)
    torch.manual_seed(0)
    with torch.device(device):
        model = FluxTransformer2DModel(**cfg)
    model.to(torch.bfloat16)
    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=16, lora_alpha=16, init_lora_weights=True,
                                 target_modules=TARGETS))
    params = lora_params_f32(model)
    if checkpointing:
        model.enable_gradient_checkpointing()
    model.train()
    opt = torch.optim.AdamW(params, lr=1e-5)
    w, h = (int(x) for x in args.pixels.split("x"))
    n = (h // 16) * (w // 16)
    lt = args.text_tokens
    g = torch.Generator(device="cpu").manual_seed(1)
    bf = dict(device=device, dtype=torch.bfloat16)
    img = torch.randn(1, n, cfg["in_channels"], generator=g).to(**bf)
    txt = torch.randn(1, lt, cfg["joint_attention_dim"], generator=g).to(**bf)
    pooled = torch.randn(1, cfg["pooled_projection_dim"], generator=g).to(**bf)
    target = torch.randn(1, n, cfg["in_channels"], generator=g).to(device)
    ids = torch.zeros(h // 16, w // 16, 3)
    ids[..., 1] = torch.arange(h // 16)[:, None]
    ids[..., 2] = torch.arange(w // 16)[None, :]
    img_ids = ids.reshape(n, 3).to(device)
    txt_ids = torch.zeros(lt, 3, device=device)
    t = torch.tensor([0.5], device=device)
    guidance = torch.tensor([1.0], device=device)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            pred = model(hidden_states=img, encoder_hidden_states=txt, pooled_projections=pooled,
                         timestep=t, img_ids=img_ids, txt_ids=txt_ids, guidance=guidance,
                         return_dict=False)[0]
        loss = torch.nn.functional.mse_loss(pred.float(), target)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    result = time_steps(step, args.steps, 2, device,
                        label="checkpointed" if checkpointing else "no checkpointing",
                        profile=args.profile)
    del model, opt, params
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="flux1-dev")
    ap.add_argument("--pixels", default="1024x1024")
    ap.add_argument("--text-tokens", type=int, default=512)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--profile", default="",
                    help="PREFIX: profile steps 3 and 4 of each configuration into "
                         "PREFIX-<configuration>.md (torch.profiler's kernel table)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if torch.cuda.is_available():
        torch.backends.cuda.enable_cudnn_sdp(False)  # its backward failed at 4608 tokens
        torch.backends.cuda.matmul.allow_tf32 = True
    import diffusers
    import peft
    cfg = model_config(preset(args.preset))
    report = {"diffusers": diffusers.__version__, "peft": peft.__version__,
              "torch": torch.__version__, "config": cfg, "runs": {}}
    for name, ckpt, autocast in (("checkpointed", True, False),
                                 ("no checkpointing, autocast", False, True)):
        try:
            report["runs"][name] = run(cfg, args, ckpt, autocast)
        except Exception as e:  # the other configuration still runs; the report says why
            report["runs"][name] = {"error": f"{type(e).__name__}: {e}"}
        print(name, json.dumps(report["runs"][name]), flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
