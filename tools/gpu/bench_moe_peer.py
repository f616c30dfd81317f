#!/usr/bin/env python3
"""The transformers + peft peer of tools/gpu/bench_moe.sh: Qwen3MoeForCausalLM (or
MixtralForCausalLM) loaded from the benchmark's checkpoint in bf16 (transformers 5 fuses the
per-expert tensors into 3-D gate_up_proj / down_proj on load), peft LoRA of rank 16 (alpha
32, no dropout) on the targets lorastream's `targets = ["q_proj", "k_proj", "v_proj",
"o_proj", "experts"]` adapts: q/k/v/o_proj as modules, the experts as peft 0.21 adapts
transformers 5's fused experts, `target_parameters` gate_up_proj and down_proj (docs/MOE.md:
peft converts per-expert targets so), gate_up_proj at rank 32 = gate's and up's rank 16 each
(as peft loads a per-expert adapter). LoRA weights and AdamW (fused) in f32, compute under
bf16 autocast, batch 1 of TOKENS ids from the benchmark's data, loss over every next token,
gradient clipping at 1.0 (lorastream's default). Timed like lorastream's steps (forward, loss,
backward, clip, optimizer step; the device synchronised per step), the median after the
warm-up steps.

The model is loaded once; configurations run one after another on it (each with a fresh
optimizer; the adapter goes on from where the last one left it): gradient checkpointing on (like lorastream's
checkpointed blocks) and off, with sdpa attention (flash_attention_2 too when flash_attn
imports) and each experts backend of transformers 5 (grouped_mm, eager); with --compile, the
fastest configuration again with every decoder layer under torch.compile. A configuration that
fails (out of memory, an unsupported backend) records its error; the others still run.

Usage (torch with CUDA, transformers 5, peft):
  python3 tools/gpu/bench_moe_peer.py --model MODEL_DIR --data data.jsonl --tokens 2048 \
      --steps 8 --warmup 3 --out peer.json [--compile] [--deadline SECONDS]
"""
import argparse
import importlib.util
import json
import statistics
import time

import torch

from bench_common import StepWindow, fastest_config, record_run, write_report  # this folder is on sys.path


def load_tokens(path):
    ids = []
    with open(path) as f:
        for line in f:
            if line.strip():
                ids.extend(json.loads(line)["input_ids"])
    return ids


def lora_config(rank, alpha):
    from peft import LoraConfig
    return LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      target_parameters=["gate_up_proj", "down_proj"],
                      rank_pattern={r".*\.gate_up_proj": 2 * rank},
                      alpha_pattern={r".*\.gate_up_proj": 2 * alpha})


def set_backends(base, attn, experts):
    """transformers 5's setters; the config's fields where a setter is missing."""
    if hasattr(base, "set_attn_implementation"):
        base.set_attn_implementation(attn)
    else:
        base.config._attn_implementation = attn
    if experts:
        if hasattr(base, "set_experts_implementation"):
            base.set_experts_implementation(experts)
        else:
            base.config._experts_implementation = experts


def run(model, cfg, args, ids, device):
    base = model.get_base_model()
    set_backends(base, cfg["attn"], cfg["experts"])
    if cfg["checkpointing"]:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        base.gradient_checkpointing_disable()
    model.train()
    forward = model
    if cfg.get("compile"):
        for layer in base.model.layers:
            layer.compile()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")
    t = args.tokens
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    times, losses = [], []
    window = StepWindow(args.profile, cfg["name"], args.warmup)
    for step in range(args.steps):
        window.before(step)
        off = (step * t) % max(1, len(ids) - t)
        x = torch.tensor(ids[off:off + t], device=device).unsqueeze(0)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = forward(input_ids=x, labels=x, use_cache=False)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
        losses.append(float(out.loss))
        del out
        window.after(step)
        print(f"  {cfg['name']}: step {step + 1}/{args.steps} {times[-1]:.3f} s loss {losses[-1]:.4f}",
              flush=True)
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    del opt, params
    timed = times[args.warmup:] if len(times) > args.warmup else times
    return {"config": cfg, "steps": len(times), "step_seconds": statistics.median(timed),
            "all_seconds": times, "losses": losses, "peak_gib": peak,
            "tokens_per_second": t / statistics.median(timed)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--compile", action="store_true", help="also the best configuration compiled")
    ap.add_argument("--configs", default="",
                    help="semicolon list of configuration names to run (default: all)")
    ap.add_argument("--deadline", type=float, default=0,
                    help="seconds after which no further configuration starts (0: none)")
    ap.add_argument("--profile", default="",
                    help="PREFIX: profile the two steps after the warm-up of each configuration "
                         "into PREFIX-<configuration>.md (torch.profiler's kernel table)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    t0 = time.time()
    import peft
    import transformers
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    report = {"torch": torch.__version__, "transformers": transformers.__version__,
              "peft": peft.__version__, "device": torch.cuda.get_device_name(device),
              "tokens": args.tokens, "steps": args.steps, "warmup": args.warmup,
              "rank": args.rank, "alpha": args.alpha, "runs": {}}
    ids = load_tokens(args.data)
    start = time.time()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16,
                                                 device_map={"": str(device)},
                                                 attn_implementation="sdpa")
    report["load_seconds"] = time.time() - start
    report["experts_implementation_default"] = getattr(model.config, "_experts_implementation", None)
    model.requires_grad_(False)
    try:
        peft_model = get_peft_model(model, lora_config(args.rank, args.alpha))
    except Exception as e:  # noqa: BLE001 - without the rank 2r of gate_up_proj, recorded
        report["peft_rank_pattern_error"] = f"{type(e).__name__}: {e}"[:600]
        from peft import LoraConfig
        peft_model = get_peft_model(model, LoraConfig(
            r=args.rank, lora_alpha=args.alpha, lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            target_parameters=["gate_up_proj", "down_proj"]))
    model = peft_model
    for p in model.parameters():  # f32 LoRA weights, as lorastream keeps them
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()
    report["lora_parameters"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    report["lora_names_block0"] = sorted(
        n for n, p in model.named_parameters() if p.requires_grad and ".layers.0." in n)
    report["peft_config"] = {k: (sorted(v) if isinstance(v, set) else v)
                             for k, v in model.peft_config["default"].to_dict().items()
                             if k in ("r", "lora_alpha", "target_modules", "target_parameters",
                                      "rank_pattern", "alpha_pattern")}
    print(f"loaded in {report['load_seconds']:.1f} s; experts default "
          f"{report['experts_implementation_default']}; {report['lora_parameters']} LoRA parameters",
          flush=True)

    attns = ["sdpa"] + (["flash_attention_2"] if importlib.util.find_spec("flash_attn") else [])
    configs = []
    for attn in attns:
        for experts in ("grouped_mm", "eager"):
            for ckpt in (True, False):
                configs.append({"name": f"{attn}, experts {experts}, "
                                        f"{'checkpointed' if ckpt else 'no checkpointing'}",
                                "attn": attn, "experts": experts, "checkpointing": ckpt})
    if args.configs:
        wanted = set(args.configs.split(";"))  # names hold commas
        configs = [c for c in configs if c["name"] in wanted]

    def attempt(cfg):
        if args.deadline and time.time() - t0 > args.deadline:
            report["runs"][cfg["name"]] = {"config": cfg, "error": "skipped: past the deadline"}
            print(cfg["name"], "skipped: past the deadline", flush=True)
        else:
            record_run(report, cfg, lambda: run(model, cfg, args, ids, device), args.out)

    for cfg in configs:
        attempt(cfg)
    if args.compile:
        best = fastest_config(report)
        if best:
            best["name"] = best["name"] + ", torch.compile per decoder layer"
            best["compile"] = True
            attempt(best)
    write_report(report, args.out, t0)


if __name__ == "__main__":
    main()
