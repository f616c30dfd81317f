#!/usr/bin/env python3
"""Training-step speed: lorastream (fully resident) against transformers + peft at its best
configuration, same GPU, same run, with and without recomputation.

Model: a 16-layer Llama-3-8B-shaped checkpoint written by lorastream-synth (bf16), rank-16
LoRA on all seven projections, batch 1, 2048 and 8192 tokens. A step is forward + backward +
AdamW on the LoRA weights, timed between two device synchronisations; median over --repeat
steps (>= 5) after --warmup steps (>= 2). Ours first (its own process: the parity pass and one
untimed step warm it up), then transformers + peft in this process. Ours is timed as training
runs it: on CUDA its micro-batch replays a CUDA graph (worker/train/micro_batch_runner.h; the second
untimed step captures it; LORASTREAM_CUDA_GRAPHS=0 in the environment times it eagerly).

Two pairs are compared, each like with like:
- recomputing: ours with every block gradient-checkpointed (the least memory) against peft with
  non-reentrant gradient checkpointing;
- keeping activations: ours with every block taped (`--taped -1`: each block keeps its
  forward's activations into its backward, what `gpu_memory_budget` chooses when memory
  allows) against peft without gradient checkpointing.
The last column puts our faster mode against their faster one.

The reference is timed in the configuration its documentation recommends and a separate
harness measured (174-188 ms at 2048 tokens where this script used to report 236 ms):
use_cache off, SDPA attention (flash kernels on bf16), torch's default matmul precision, at
least two warm-up steps (one left the allocator and the kernels' first-use costs inside the
timed steps), peak memory reset per measurement. peft keeps its LoRA weights in f32 (as ours
does); without autocast it runs every LoRA matmul in f32 and casts activations to f32 and
back; under torch.autocast(bf16) (what Trainer's bf16=True does) they run in bf16. Both are
measured, with and without checkpointing; the faster of each pair is "theirs". A variant that
runs out of memory is reported as such.
Usage: speed.py --bin BUILD/bin --out DIR [--lengths 2048,8192] [--repeat 7] [--warmup 3]
"""
import argparse
import contextlib
import gc
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

def ours(bin_dir, model_dir, tokens_path, out_dir, repeat, device, taped):
    cmd = [os.path.join(bin_dir, "lorastream-worker"), "parity", "--model", model_dir,
           "--tokens", tokens_path, "--out", out_dir, "--dtype", "bf16", "--device", device,
           "--rank", "16", "--repeat", str(repeat), "--taped", "-1" if taped else "0"]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    with open(os.path.join(out_dir, "speed.json")) as f:
        j = json.load(f)
        return (j["median_step_seconds"], j.get("profile", {}).get("peak_device_bytes", 0),
                bool(j.get("cuda_graph")))


# The reference's variants: name -> (torch.autocast(bf16) on, gradient checkpointing on).
VARIANTS = {"f32 LoRA, checkpointed": (False, True), "autocast bf16, checkpointed": (True, True),
            "f32 LoRA, no checkpointing": (False, False),
            "autocast bf16, no checkpointing": (True, False)}


def peft_lora(model):
    """The LoRA both peer harnesses train: rank 16, alpha 32 on all seven projections."""
    from peft import LoraConfig, get_peft_model
    return get_peft_model(model, LoraConfig(
        r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                        "down_proj"]))


def timed_steps(model, params, ids, repeat, warmup, device, autocast, times):
    """The peer's training step (forward and loss, backward, AdamW) between two device
    synchronisations, `warmup` + `repeat` times, the timed steps' seconds appended to `times`
    (those done stay there if a step runs out of memory): the peak device memory and the last
    loss."""
    opt = torch.optim.AdamW(params, lr=1e-5)
    ctx = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if autocast \
        else contextlib.nullcontext
    torch.cuda.reset_peak_memory_stats(device)
    for r in range(warmup + repeat):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        with ctx():
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        if r >= warmup:
            times.append(time.perf_counter() - t0)
    return torch.cuda.max_memory_allocated(device), loss.item()


def reference(model_dir, ids, repeat, warmup, device, autocast, checkpointing):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, **dtype_kwarg(torch.bfloat16),
                                                 attn_implementation="sdpa").to(device)
    model.config.use_cache = False
    if checkpointing:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
    model = peft_lora(model)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    times = []
    try:
        peak, _ = timed_steps(model, params, ids.to(device), repeat, warmup, device, autocast,
                              times)
        result = (statistics.median(times), times, peak)
    except torch.cuda.OutOfMemoryError:
        result = (None, times, None)
    del model, params
    gc.collect()
    torch.cuda.empty_cache()
    return result


def write_table(lines, path):
    """Prints a markdown table's lines and writes them to `path`."""
    table = "\n".join(lines)
    print(table)
    with open(path, "w") as f:
        f.write(table + "\n")


def fastest(variants, checkpointing=None):
    """The name of the fastest variant that ran (of one checkpointing setting), or None."""
    ran = [k for k, v in variants.items() if v["median_s"] is not None and
           (checkpointing is None or VARIANTS[k][1] == checkpointing)]
    return min(ran, key=lambda k: variants[k]["median_s"]) if ran else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--lengths", default="2048,8192")
    ap.add_argument("--repeat", type=int, default=7, help="timed steps (>= 5)")
    ap.add_argument("--warmup", type=int, default=3, help="reference warm-up steps (>= 2)")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--model-dir", default="", help="reuse a synth checkpoint")
    args = ap.parse_args()
    if args.repeat < 5 or args.warmup < 2:
        ap.error("--repeat must be >= 5 and --warmup >= 2 (a median of fewer steps, or one "
                 "warm-up, is not a measurement of the peer at its best)")
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
        ours_s, ours_peak, ours_graph = {}, {}, {}
        for mode, taped in (("checkpointed", False), ("taped", True)):
            ours_s[mode], ours_peak[mode], ours_graph[mode] = ours(
                args.bin, model_dir, tokens_path, os.path.join(args.out, f"ours_{mode}_{n}"),
                args.repeat, args.device, taped)
        variants = {}
        for name, (autocast, checkpointing) in VARIANTS.items():
            median, times, peak = reference(model_dir, ids, args.repeat, args.warmup,
                                            args.device, autocast, checkpointing)
            variants[name] = {"median_s": median, "step_seconds": times, "peak_bytes": peak}
            print(f"transformers+peft ({name}), {n} tokens: " +
                  (f"median {median:.4f} s" if median is not None else "out of memory"),
                  flush=True)
        best_ckpt, best_kept, best = (fastest(variants, True), fastest(variants, False),
                                      fastest(variants))

        def t(k):
            return variants[k]["median_s"] if k else None

        def ratio(a, b):
            return a / b if a and b else None

        rows.append({"tokens": n, "ours_s": ours_s["checkpointed"],
                     "ours_taped_s": ours_s["taped"],
                     "ours_peak_bytes": ours_peak["checkpointed"],
                     "ours_taped_peak_bytes": ours_peak["taped"],
                     "ours_cuda_graph": ours_graph["checkpointed"] and ours_graph["taped"],
                     "hf_peft_s": t(best_ckpt), "hf_peft_best": best_ckpt,
                     "hf_peft_no_ckpt_s": t(best_kept), "hf_peft_no_ckpt_best": best_kept,
                     "ratio_ours_over_hf": ratio(ours_s["checkpointed"], t(best_ckpt)),
                     "ratio_taped_over_hf_no_ckpt": ratio(ours_s["taped"], t(best_kept)),
                     "ratio_fastest": ratio(min(ours_s.values()), t(best)),
                     "hf_peft_variants": variants, "warmup": args.warmup,
                     "repeat": args.repeat})
        print({k: v for k, v in rows[-1].items() if k != "hf_peft_variants"}, flush=True)

    def cell(seconds, variant=None):
        if seconds is None:
            return "out of memory"
        return f"{seconds * 1e3:.1f}" + (f" ({variant})" if variant else "")

    def gib(b):
        return f"{b / 2**30:.2f}" if b else "-"

    def r3(x):
        return f"**{x:.3f}**" if x is not None else "-"

    lines = ["| tokens | ours, checkpointed (ms) | theirs, checkpointed (ms, best) | ratio "
             "| ours, every block taped (ms) | theirs, no checkpointing (ms, best) | ratio "
             "| our fastest / their fastest | peak GiB: ours ckpt / taped, theirs ckpt / none |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        def peak(k):
            return gib(r["hf_peft_variants"][k]["peak_bytes"]) if k else "-"

        lines.append(
            f"| {r['tokens']} | {cell(r['ours_s'])} "
            f"| {cell(r['hf_peft_s'], r['hf_peft_best'])} | {r3(r['ratio_ours_over_hf'])} "
            f"| {cell(r['ours_taped_s'])} "
            f"| {cell(r['hf_peft_no_ckpt_s'], r['hf_peft_no_ckpt_best'])} "
            f"| {r3(r['ratio_taped_over_hf_no_ckpt'])} | {r3(r['ratio_fastest'])} "
            f"| {gib(r['ours_peak_bytes'])} / {gib(r['ours_taped_peak_bytes'])}, "
            f"{peak(r['hf_peft_best'])} / {peak(r['hf_peft_no_ckpt_best'])} |")
    graphed = all(r["ours_cuda_graph"] for r in rows)
    lines.append(f"(median of {args.repeat} steps; ours "
                 f"{'replayed from a CUDA graph' if graphed else 'eager'}; reference after "
                 f"{args.warmup} warm-up steps, SDPA, use_cache off; checkpointing non-reentrant)")
    write_table(lines, os.path.join(args.out, "speed.md"))
    with open(os.path.join(args.out, "speed.json"), "w") as f:
        json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
