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

With --musubi-offloader PATH (musubi-tuner's src/musubi_tuner/modules/custom_offloading_utils.py,
no part of this repository) the model streams instead, as musubi-tuner trains Qwen-Image with
--blocks_to_swap N --block_swap_h2d_only --gradient_checkpointing: loaded on the host, --swap
of its blocks streamed Host->Device by musubi-tuner's LoRAStreamOffloader (pinned host masters,
--ring device slots, the streamed blocks at even intervals: its placement), the other blocks
and the rest resident, wired around diffusers' block loop as musubi-tuner's own Qwen-Image model
drives it: diffusers calls its gradient-checkpointing function (given here) with each block and
its inputs, and that function waits for the block (wait_for_block), runs it checkpointed
(non-reentrant) and frees its slot and prefetches (submit_move_blocks_forward); the offloader's
backward hooks on the blocks prefetch during the backward. The configurations then: checkpointed
with SDPA as torch chooses and forced to each of its kernels; each records the bytes the
offloader copied per step; the report adds "musubi" (the offloader's plan and the measured
pinned H2D bandwidth of one block's copy).

Usage (diffusers v0.39's src/ on PYTHONPATH, torch with CUDA, peft):
  PYTHONPATH=.diffusers/src python3 tools/gpu/bench_qwen_image_peer.py \
      --model WORK/model/transformer --pixels 1024x1024 --text-tokens 256 --steps 6 \
      --warmup 2 --out peer.json [--deadline 60] [--compile] [--configs 'NAME;NAME']
      [--musubi-offloader PATH --swap 45 --ring 2]
"""
import argparse
import contextlib
import time

import torch
from peft import LoraConfig
from torch.utils.checkpoint import checkpoint

# (this folder is on sys.path)
from bench_common import (fastest_config, h2d_bandwidth, load_musubi_offloading, lora_params_f32,
                          musubi_offloader, record_run, time_steps, write_report)
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


def add_lora(model, rank):
    """peft LoRA of `rank` (alpha = rank) on TARGETS, its weights in f32; the base frozen."""
    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=rank, lora_alpha=rank, init_lora_weights=True,
                                 target_modules=TARGETS))
    lora_params_f32(model)


def load_streamed(args, device):
    """The checkpoint's model streamed by musubi-tuner's LoRAStreamOffloader, with LoRA, as
    musubi-tuner sets it up (training/trainer_base.py: the model loaded on the host,
    enable_block_swap, move_to_device_except_swap_blocks, the network, then
    prepare_block_swap_before_forward once). Returns the model, the offloader and the
    gradient-checkpointing function that drives it around diffusers' block loop."""
    offloading = load_musubi_offloading(args.musubi_offloader)  # a wrong path: before the load
    if device.type != "cuda":
        raise SystemExit("--musubi-offloader: musubi-tuner's LoRAStreamOffloader runs on CUDA only")
    model = QwenImageTransformer2DModel.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    model.requires_grad_(False)  # the offloader refuses a trainable streamed weight
    blocks = list(model.transformer_blocks)
    if not 1 <= args.swap < len(blocks):  # musubi-tuner's enable_block_swap: at most N - 1
        raise SystemExit(f"--swap {args.swap}: must be 1 to {len(blocks) - 1} "
                         f"(the model has {len(blocks)} blocks)")
    offloader = musubi_offloader(offloading, "qwen-image-block", blocks, args.swap, args.ring,
                                 device)
    add_lora(model, args.rank)
    for name, child in model.named_children():  # move_to_device_except_swap_blocks
        if name != "transformer_blocks":
            child.to(device)
    index = {id(b): i for i, b in enumerate(blocks)}

    def checkpointed_block(block, *inputs):
        # musubi-tuner's QwenModel.forward around each block: the wait and the prefetch outside
        # the checkpoint, so that the backward's recompute neither waits nor prefetches again
        # (its backward hooks do, block by block).
        i = index[id(block)]
        offloader.wait_for_block(i)
        out = checkpoint(block, *inputs, use_reentrant=False)
        offloader.submit_move_blocks_forward(blocks, i)
        return out

    offloader.prepare_block_devices_before_forward(blocks)
    # Everything but the streamed blocks' frozen weights (on the host between their uses).
    off_device = [n for n, p in model.named_parameters()
                  if p.device.type != device.type and not (n.startswith("transformer_blocks.") and
                                                           not p.requires_grad)]
    if off_device:
        raise SystemExit(f"not on {device} after the offloader's preparation: {off_device[:4]}")
    return model, offloader, checkpointed_block


def sdpa_context(kernel):
    if not kernel:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel({"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                        "efficient": SDPBackend.EFFICIENT_ATTENTION}[kernel])


def run(model, cfg, args, inputs, device, checkpoint_func=None, h2d_meter=None):
    """One configuration's timed steps. checkpoint_func: diffusers' gradient-checkpointing
    function (None: its own); h2d_meter: the bytes an offloader has copied so far (its figures
    then hold h2d_bytes, the bytes each step copied)."""
    model.set_attention_backend(cfg.get("backend", "native"))
    if cfg["checkpointing"]:
        model.enable_gradient_checkpointing(checkpoint_func)
    else:
        model.disable_gradient_checkpointing()
    if cfg.get("compile"):
        model.compile_repeated_blocks()
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")
    x, txt, mask, shapes = inputs
    g = torch.Generator(device=device).manual_seed(3)
    h2d_bytes = []

    def step():
        copied = h2d_meter() if h2d_meter else 0
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
        if h2d_meter:
            h2d_bytes.append(h2d_meter() - copied)
        return loss.detach()

    try:
        figures = time_steps(step, args.steps, args.warmup, device, args.deadline, cfg["name"],
                             profile=args.profile)
        if h2d_meter:
            figures["h2d_bytes"] = h2d_bytes
        return figures
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
    ap.add_argument("--musubi-offloader", default="",
                    help="musubi-tuner's src/musubi_tuner/modules/custom_offloading_utils.py: "
                         "stream --swap blocks by its LoRAStreamOffloader instead (above)")
    ap.add_argument("--swap", type=int, default=0,
                    help="with --musubi-offloader: the blocks streamed (musubi-tuner's "
                         "--blocks_to_swap)")
    ap.add_argument("--ring", type=int, default=2,
                    help="with --musubi-offloader: its device slots (--block_swap_ring_size)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.musubi_offloader and args.swap < 1:
        ap.error("--musubi-offloader needs --swap N (N >= 1)")
    if args.musubi_offloader and args.ring < 1:
        ap.error("--ring must be >= 1")
    t0 = time.time()
    import diffusers
    import peft

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    start = time.time()
    offloader = checkpoint_func = h2d_meter = None
    if args.musubi_offloader:
        model, offloader, checkpoint_func = load_streamed(args, device)
        h2d_meter = lambda: offloader.h2d_bytes_copied  # noqa: E731
    else:
        model = load(args.model, device)
        add_lora(model, args.rank)
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
    if offloader is not None:
        block_bytes = offloader._layout[1]  # one streamed block's Linear weights, as copied
        try:  # the PCIe floor's rate; without it the table prints no floor
            bandwidth = h2d_bandwidth(block_bytes, device)
        except RuntimeError as e:
            print(f"the H2D bandwidth could not be measured: {e}", flush=True)
            bandwidth = None
        report["musubi"] = {
            "offloader": args.musubi_offloader, "class": type(offloader).__name__,
            "swap": args.swap, "streamed": offloader.S, "ring": offloader.B,
            "blocks": len(model.transformer_blocks), "stream_idx": offloader.stream_idx,
            "pinned": offloader.use_pinned_memory, "block_bytes": block_bytes,
            "h2d_bytes_per_second": bandwidth}
        print(f"musubi-tuner {report['musubi']['class']}: {offloader.S} of "
              f"{report['musubi']['blocks']} blocks streamed through {offloader.B} slots "
              f"(blocks {offloader.stream_idx}), {block_bytes / 2**20:.0f} MiB each; pinned H2D "
              f"{bandwidth / 1e9 if bandwidth else float('nan'):.1f} GB/s", flush=True)
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
            record_run(report, c, lambda: run(model, c, args, inputs, device, checkpoint_func,
                                              h2d_meter), args.out)

    if offloader is not None:
        # musubi-tuner's H2D-only swap trains checkpointed only (it refuses otherwise).
        for k in ("", "flash", "cudnn", "efficient"):
            attempt({"name": f"musubi-tuner LoRAStreamOffloader, swap {args.swap} ring "
                             f"{args.ring}, checkpointed, SDPA{' ' + k if k else ''}",
                     "checkpointing": True, "sdpa": k, "musubi": True})
        # Between steps the ring holds its slots' blocks and every other streamed block's
        # weights are its host master (a check that the blocks stream at all).
        report["musubi"]["streamed_on_host_between_steps"] = sum(
            1 for i in offloader.stream_idx if offloader._modules(i)[0].weight.device.type == "cpu")
        write_report(report, args.out, t0)
        return

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
