#!/usr/bin/env python3
"""Training-step speed: lorastream (fully resident) against transformers + peft with gradient
checkpointing, same GPU, same run.

Model: a 16-layer Llama-3-8B-shaped checkpoint written by lorastream-synth (bf16), rank-16
LoRA on all seven projections, batch 1, 2048 and 8192 tokens. A step is forward + backward +
AdamW on the LoRA weights; median over --repeat steps after one warm-up. Ours first (its own
process), then transformers + peft in this process (sdpa attention, non-reentrant
checkpointing, TF32 off as for the parity runs).
Usage: speed.py --bin BUILD/bin --out DIR [--lengths 2048,8192] [--repeat 5]
"""
import argparse
import json
import os
import statistics
import subprocess
import time

import torch
from safetensors.torch import save_file



def dtype_kwarg(dtype):
    """transformers >= 4.56 calls it `dtype` (5.x drops `torch_dtype`)."""
    import transformers
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}

def ours(bin_dir, model_dir, tokens_path, out_dir, repeat, device):
    cmd = [os.path.join(bin_dir, "lorastream-worker"), "parity", "--model", model_dir,
           "--tokens", tokens_path, "--out", out_dir, "--dtype", "bf16", "--device", device,
           "--rank", "16", "--repeat", str(repeat)]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    with open(os.path.join(out_dir, "speed.json")) as f:
        return json.load(f)["median_step_seconds"]


def reference(model_dir, ids, repeat, device):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, **dtype_kwarg(torch.bfloat16),
                                                 attn_implementation="sdpa").to(device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model = get_peft_model(model, LoraConfig(
        r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                        "down_proj"]))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    ids = ids.to(device)
    times = []
    for r in range(repeat + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if r > 0:
            times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated()
    del model, opt, params
    torch.cuda.empty_cache()
    return statistics.median(times), peak


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--lengths", default="2048,8192")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--model-dir", default="", help="reuse a synth checkpoint")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    os.makedirs(args.out, exist_ok=True)
    model_dir = args.model_dir or os.path.join(args.out, "llama-3-8b-16l")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        cmd = [os.path.join(args.bin, "lorastream-synth"), "--preset", "llama-3-8b",
               "--layers", "16", "--dtype", "bf16", "--out", model_dir]
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    with open(os.path.join(model_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]

    rows = []
    for n in [int(x) for x in args.lengths.split(",")]:
        torch.manual_seed(n)
        ids = torch.randint(0, vocab, (1, n), dtype=torch.int64)
        tokens_path = os.path.join(args.out, f"tokens_{n}.safetensors")
        save_file({"input_ids": ids}, tokens_path)
        t_ours = ours(args.bin, model_dir, tokens_path, os.path.join(args.out, f"ours_{n}"),
                      args.repeat, args.device)
        t_ref, peak_ref = reference(model_dir, ids, args.repeat, args.device)
        rows.append({"tokens": n, "ours_s": t_ours, "hf_peft_s": t_ref,
                     "ratio_ours_over_hf": t_ours / t_ref, "hf_peak_bytes": peak_ref})
        print(rows[-1], flush=True)

    lines = ["| tokens | ours (s/step) | transformers+peft (s/step) | ours / theirs |",
             "| --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['tokens']} | {r['ours_s']:.4f} | {r['hf_peft_s']:.4f} "
                     f"| {r['ratio_ours_over_hf']:.3f} |")
    table = "\n".join(lines)
    print(table)
    with open(os.path.join(args.out, "speed.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(args.out, "speed.json"), "w") as f:
        json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
