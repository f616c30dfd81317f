#!/usr/bin/env python3
"""The diffusers + peft peer of tools/gpu/bench_qwen_image.sh: QwenImageTransformer2DModel
loaded from the benchmark's own checkpoint (lorastream-synth --qwen-image-format diffusers
writes transformer/config.json and the weights, so the shapes and the weights are ours) in
bf16, peft LoRA of rank 16 (alpha 16) on the targets lorastream's Qwen-Image default adapts
(musubi-tuner's: every Linear of a block but the modulations img_mod.1 / txt_mod.1), LoRA
weights and AdamW in f32, compute under bf16 autocast. One latent of PIXELS (2x2 patches of
the 16-channel latent: 64 wide, (W/16)(H/16) image tokens) and TEXT_TOKENS caption tokens of
Qwen2.5-VL's hidden states (the checkpoint's joint_attention_dim wide); flow matching: t ~
U(0, 1), noisy = (1 - t) x + t noise, MSE of the prediction against noise - x; gradient
clipping at 1.0 (lorastream's default). Timed like lorastream's steps (forward, loss,
backward, clip, optimizer step; the device synchronised per step), the median after the
warm-up steps.

The model is loaded once; the configurations run one after another on it (each with a fresh
optimizer), each within --deadline seconds; one that fails (out of memory, a backend missing
or without a backward, past its deadline) records its error and the others still run:
  - gradient checkpointing on (like lorastream's checkpointed blocks), attention by torch's SDPA
    as it chooses, and forced to each of its flash, cuDNN and memory-efficient kernels
    (torch.nn.attention.sdpa_kernel around forward and backward, so the recompute too);
  - off (every activation kept), with the fastest of those;
  - on, with each attention backend of diffusers' dispatcher that is not torch's SDPA
    (model.set_attention_backend: flash-attn 2, 3, sageattention, xformers; its _native_*
    backends are the SDPA kernels above);
  - on, SDPA, with the all-ones text mask QwenImagePipeline passes (masked attention: no flash);
  - with --compile, the fastest configuration again with every block under torch.compile
    (model.compile_repeated_blocks).
A batch of one caption needs no mask (nothing is padded), so the other configurations pass
none, as lorastream does.

Usage (diffusers v0.39's src/ on PYTHONPATH, torch with CUDA, peft):
  PYTHONPATH=.diffusers/src python3 tools/gpu/bench_qwen_image_peer.py \
      --model WORK/model/transformer --pixels 1024x1024 --text-tokens 256 --steps 6 \
      --warmup 2 --out peer.json [--deadline 60] [--compile] [--configs 'NAME;NAME']
"""
import argparse
import contextlib
import time

import torch
from peft import LoraConfig

# (this folder is on sys.path)
from bench_common import fastest_config, lora_params_f32, record_run, time_steps, write_report
from diffusers import QwenImageTransformer2DModel

# lorastream's Qwen-Image `targets = ["default"]` (worker/qwen_image/qwen_image_adapter_io.h)
TARGETS = (r".*transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|"
           r"add_v_proj|to_add_out)|img_mlp\.net\.(0\.proj|2)|txt_mlp\.net\.(0\.proj|2))")
DISPATCHER = ["flash", "_flash_3", "sage", "xformers"]


def load(path, device):
    """The checkpoint folder's model in bf16 on the device (loaded there directly when
    diffusers can, else through the host)."""
    try:
        return QwenImageTransformer2DModel.from_pretrained(path, torch_dtype=torch.bfloat16,
                                                           device_map=str(device))
    except Exception as e:  # noqa: BLE001 - e.g. accelerate missing: the plain way
        print(f"from_pretrained with device_map={device} failed ({e}); loading on the host",
              flush=True)
        return QwenImageTransformer2DModel.from_pretrained(
            path, torch_dtype=torch.bfloat16).to(device)


def sdpa_context(kernel):
    if not kernel:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel({"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                        "efficient": SDPBackend.EFFICIENT_ATTENTION}[kernel])


def run(model, cfg, args, inputs, device):
    model.set_attention_backend(cfg.get("backend", "native"))
    if cfg["checkpointing"]:
        model.enable_gradient_checkpointing()
    else:
        model.disable_gradient_checkpointing()
    if cfg.get("compile"):
        model.compile_repeated_blocks()
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")
    x, txt, mask, shapes = inputs
    g = torch.Generator(device=device).manual_seed(3)

    def step():
        noise = torch.randn(x.shape, generator=g, device=device, dtype=torch.float32)
        t = torch.rand(1, generator=g, device=device)
        noisy = ((1 - t) * x.float() + t * noise).to(torch.bfloat16)
        with sdpa_context(cfg.get("sdpa")):  # the backward's recompute too
            with torch.autocast(device.type, dtype=torch.bfloat16):
                pred = model(hidden_states=noisy, encoder_hidden_states=txt,
                             encoder_hidden_states_mask=mask if cfg.get("mask") else None,
                             timestep=t, img_shapes=shapes, return_dict=False)[0]
            loss = torch.nn.functional.mse_loss(pred.float(), noise - x.float())
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    try:
        return time_steps(step, args.steps, args.warmup, device, args.deadline, cfg["name"],
                          profile=args.profile)
    finally:
        opt.zero_grad(set_to_none=True)
        del opt, params


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="the diffusers folder (transformer/)")
    ap.add_argument("--pixels", default="1024x1024")
    ap.add_argument("--text-tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--deadline", type=float, default=60,
                    help="seconds each configuration may take (0: none)")
    ap.add_argument("--compile", action="store_true", help="also the fastest one compiled")
    ap.add_argument("--configs", default="",
                    help="semicolon list of configuration names to run (default: all)")
    ap.add_argument("--profile", default="",
                    help="PREFIX: profile the two steps after the warm-up of each configuration "
                         "into PREFIX-<configuration>.md (torch.profiler's kernel table)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    t0 = time.time()
    import diffusers
    import peft

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    start = time.time()
    model = load(args.model, device)
    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=args.rank, lora_alpha=args.rank, init_lora_weights=True,
                                 target_modules=TARGETS))
    lora_params_f32(model)
    cfg = dict(model.config)
    report = {"diffusers": diffusers.__version__, "peft": peft.__version__,
              "torch": torch.__version__,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "config": {k: v for k, v in cfg.items() if not k.startswith("_")},
              "pixels": args.pixels, "text_tokens": args.text_tokens, "steps": args.steps,
              "warmup": args.warmup, "rank": args.rank, "deadline_seconds": args.deadline,
              "load_seconds": time.time() - start,
              "lora_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
              "lora_modules": sum(1 for n, _ in model.named_modules() if n.endswith(".lora_A")),
              "runs": {}}
    print(f"loaded in {report['load_seconds']:.1f} s; {report['lora_modules']} LoRA modules, "
          f"{report['lora_parameters']} parameters", flush=True)

    w, h = (int(v) for v in args.pixels.split("x"))
    if w % 16 or h % 16:
        raise SystemExit(f"--pixels {args.pixels}: width and height must be multiples of 16")
    n = (h // 16) * (w // 16)
    gen = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(1, n, cfg["in_channels"], generator=gen).to(device, torch.bfloat16)
    txt = torch.randn(1, args.text_tokens, cfg["joint_attention_dim"], generator=gen).to(
        device, torch.bfloat16)
    mask = torch.ones(1, args.text_tokens, dtype=torch.bool, device=device)
    inputs = (x, txt, mask, [(1, h // 16, w // 16)])

    wanted = set(args.configs.split(";")) if args.configs else None  # names hold commas

    def attempt(c):
        if wanted is None or c["name"] in wanted:
            record_run(report, c, lambda: run(model, c, args, inputs, device), args.out)

    # The likeliest fastest first: a timeout of the whole run keeps what ran.
    attempt({"name": "checkpointed, SDPA", "checkpointing": True})
    for k in ("flash", "cudnn", "efficient"):
        attempt({"name": f"checkpointed, SDPA {k}", "checkpointing": True, "sdpa": k})
    best = fastest_config(report) or {"name": "checkpointed, SDPA", "checkpointing": True}
    off = {k: v for k, v in best.items() if k != "name"}
    off.update(checkpointing=False, name=best["name"].replace("checkpointed", "no checkpointing"))
    attempt(off)
    for b in DISPATCHER:
        attempt({"name": f"checkpointed, diffusers backend {b}", "checkpointing": True,
                 "backend": b})
    attempt({"name": "checkpointed, SDPA, all-ones text mask", "checkpointing": True,
             "mask": True})
    if args.compile:
        best = fastest_config(report)
        if best:
            best.update(compile=True, name=best["name"] + ", torch.compile per block")
            attempt(best)
    write_report(report, args.out, t0)


if __name__ == "__main__":
    main()
