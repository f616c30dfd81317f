#!/usr/bin/env python3
"""Parity of lorastream's model, LoRA and adapter format against transformers + peft.

For each of llama, mistral, qwen2, qwen3 (small random configs covering llama3 rope scaling,
GQA, qwen2 q/k/v bias + tied embeddings, qwen3 q/k norm with head_dim != hidden/heads):
  1. transformers saves a random model (save_pretrained, safetensors), f32;
  2. peft wraps it with a LoRA on all seven projections whose B is random (non-zero), saved
     with save_pretrained; a token batch (with a masked prompt) is written as safetensors;
  3. `lorastream-worker parity` computes logits, loss and every LoRA gradient (f32 and bf16);
  4. transformers + peft compute the same (TF32 off; bf16 under torch.autocast, the LoRA
     matmuls in bf16 as ours), and the relative errors are printed:
     max|ours - ref| / max|ref| per tensor (for gradients: the worst tensor);
  5. peft loads OUR re-saved adapter (PeftModel.from_pretrained) and must reproduce our logits;
  6. (llama) `lorastream-worker train` trains a few steps on that model; peft loads the
     trained adapter and must reproduce the logits of our parity run with it.
Targets: logits f32 <= 1e-4, loss and gradients f32 <= 1e-4; bf16 is reported.
Usage: parity.py --worker BIN/lorastream-worker --out DIR [--device cuda:0] [--models llama,...]
"""
import argparse
import contextlib
import json
import os
import subprocess
import sys

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
F32_LIMIT = 1e-4



def dtype_kwarg(dtype):
    """transformers >= 4.56 calls it `dtype` (5.x drops `torch_dtype`)."""
    import transformers
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}

def rope_kwargs(theta, scaling=None):
    """transformers >= 5 takes rope_parameters (theta inside); older ones rope_theta/_scaling."""
    import transformers
    if int(transformers.__version__.split(".")[0]) >= 5:
        params = dict(scaling or {"rope_type": "default"})
        params["rope_theta"] = theta
        return {"rope_parameters": params}
    kw = {"rope_theta": theta}
    if scaling:
        kw["rope_scaling"] = scaling
    return kw


def make_config(model_type):
    common = dict(hidden_size=128, intermediate_size=344, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                  max_position_embeddings=512, rms_norm_eps=1e-5)
    if model_type == "llama":
        from transformers import LlamaConfig
        return LlamaConfig(**common, tie_word_embeddings=False, **rope_kwargs(
            500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64}))
    if model_type == "mistral":
        from transformers import MistralConfig
        return MistralConfig(**common, sliding_window=None, tie_word_embeddings=False,
                             **rope_kwargs(1000000.0))
    if model_type == "qwen2":
        from transformers import Qwen2Config
        return Qwen2Config(**common, tie_word_embeddings=True, use_sliding_window=False,
                           **rope_kwargs(1000000.0))
    if model_type == "qwen3":
        from transformers import Qwen3Config
        return Qwen3Config(**common, head_dim=48, tie_word_embeddings=False,
                           use_sliding_window=False, **rope_kwargs(1000000.0))
    raise ValueError(model_type)


def rel(ours, ref):
    ours = ours.double().cpu()
    ref = ref.double().cpu()
    denom = ref.abs().max().item()
    return (ours - ref).abs().max().item() / (denom if denom > 0 else 1.0)


def peft_key(name):
    # "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight" -> saved key
    return name.replace(".default.", ".")


def run_worker(worker, args):
    cmd = [worker] + args
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def reference(model_dir, adapter_dir, tokens, dtype, device):
    base = AutoModelForCausalLM.from_pretrained(model_dir, **dtype_kwarg(dtype),
                                                attn_implementation="sdpa").to(device)
    model = PeftModel.from_pretrained(base, adapter_dir, is_trainable=True).to(device)
    model.train()
    ids = tokens["input_ids"].to(device)
    labels = tokens["labels"].to(device)
    # bf16 as torch.autocast runs it (Trainer's bf16=True): the LoRA matmuls in bf16 from the
    # f32 adapter weights, which is lorastream's bf16 arithmetic. f32 runs plain.
    autocast = (torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)
                if dtype == torch.bfloat16 else contextlib.nullcontext())
    with autocast:
        out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    grads = {peft_key(n): p.grad.detach().float().cpu()
             for n, p in model.named_parameters() if "lora_" in n and p.grad is not None}
    return out.logits.detach().float().cpu(), out.loss.detach().float().cpu(), grads


def logits_only(model_dir, adapter_dir, tokens, device):
    base = AutoModelForCausalLM.from_pretrained(model_dir, **dtype_kwarg(torch.float32),
                                                attn_implementation="sdpa").to(device)
    model = PeftModel.from_pretrained(base, adapter_dir).to(device).eval()
    with torch.no_grad():
        return model(input_ids=tokens["input_ids"].to(device)).logits.float().cpu()


def one_model(model_type, worker, out_root, device, seed):
    torch.manual_seed(seed)
    root = os.path.join(out_root, model_type)
    os.makedirs(root, exist_ok=True)
    model_dir = os.path.join(root, "model")
    adapter_dir = os.path.join(root, "peft_adapter")
    tokens_path = os.path.join(root, "tokens.safetensors")

    config = make_config(model_type)
    model = AutoModelForCausalLM.from_config(config, **dtype_kwarg(torch.float32))
    with torch.no_grad():  # random norms and biases too, so that every weight matters
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.02)
    model.save_pretrained(model_dir, safe_serialization=True)
    lcfg = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS,
                      use_rslora=(model_type == "qwen2"), task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, lcfg)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    peft_model.save_pretrained(adapter_dir)
    ids = torch.randint(0, config.vocab_size, (2, 64), dtype=torch.int64)
    labels = ids.clone()
    labels[:, :5] = -100
    save_file({"input_ids": ids, "labels": labels}, tokens_path)
    tokens = {"input_ids": ids, "labels": labels}
    del model, peft_model

    result = {"model_type": model_type}
    for dtype_name, dtype in (("f32", torch.float32), ("bf16", torch.bfloat16)):
        ours_dir = os.path.join(root, "ours_" + dtype_name)
        run_worker(worker, ["parity", "--model", model_dir, "--tokens", tokens_path,
                            "--adapter", adapter_dir, "--out", ours_dir, "--dtype", dtype_name,
                            "--device", device])
        ours = load_file(os.path.join(ours_dir, "parity.safetensors"))
        ref_logits, ref_loss, ref_grads = reference(model_dir, adapter_dir, tokens, dtype, device)
        grad_errs = {}
        for key, g in ref_grads.items():
            ours_g = ours.get("grad." + key)
            if ours_g is None:
                raise SystemExit(f"{model_type}: our output lacks the gradient of {key}")
            grad_errs[key] = rel(ours_g, g)
        missing = [k for k in ours if k.startswith("grad.") and k[5:] not in ref_grads]
        if missing:
            raise SystemExit(f"{model_type}: gradients peft does not have: {missing[:3]}")
        worst = max(grad_errs, key=grad_errs.get)
        result[dtype_name] = {
            "logits_rel": rel(ours["logits"], ref_logits),
            "loss_rel": rel(ours["loss"].reshape(()), ref_loss),
            "loss_ours": ours["loss"].item(),
            "loss_ref": ref_loss.item(),
            "grad_rel_max": grad_errs[worst],
            "grad_rel_worst_tensor": worst,
            "grad_tensors": len(grad_errs),
        }
        if dtype_name == "f32":
            # peft loads the adapter as OUR writer saved it and must give our logits.
            peft_logits = logits_only(model_dir, os.path.join(ours_dir, "adapter"), tokens, device)
            result["f32"]["our_adapter_in_peft_logits_rel"] = rel(ours["logits"], peft_logits)

    if model_type == "llama":
        result["trained_adapter_in_peft_logits_rel"] = trained_adapter_check(
            worker, root, model_dir, tokens, tokens_path, device)
    return result


def trained_adapter_check(worker, root, model_dir, tokens, tokens_path, device):
    data = os.path.join(root, "train.jsonl")
    with open(data, "w") as f:
        for row in tokens["input_ids"].tolist():
            f.write(json.dumps({"input_ids": row}) + "\n")
    job = os.path.join(root, "job.toml")
    out = os.path.join(root, "trained")
    with open(job, "w") as f:
        f.write(f'name = "parity"\n[model]\ncheckpoint = "{model_dir}"\n'
                f'[data]\npath = "{data}"\nseq_len = 64\n'
                f'[lora]\nrank = 4\nalpha = 8\n[optim]\nlr = 1e-2\n'
                f'[train]\nsteps = 3\nbatch_size = 2\ndtype = "f32"\noutput_dir = "{out}"\n')
    run_worker(worker, ["train", job, "--device", device, "--no-resume"])
    ours_dir = os.path.join(root, "ours_trained")
    run_worker(worker, ["parity", "--model", model_dir, "--tokens", tokens_path,
                        "--adapter", out, "--out", ours_dir, "--dtype", "f32", "--device", device])
    ours = load_file(os.path.join(ours_dir, "parity.safetensors"))
    return rel(ours["logits"], logits_only(model_dir, out, tokens, device))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--models", default="llama,mistral,qwen2,qwen3")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    os.makedirs(args.out, exist_ok=True)

    results = [one_model(m, args.worker, args.out, args.device, args.seed)
               for m in args.models.split(",")]
    ok = True
    lines = ["| model | dtype | logits rel | loss rel | worst grad rel (of N) | our adapter in peft |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in results:
        for d in ("f32", "bf16"):
            x = r[d]
            lines.append(f"| {r['model_type']} | {d} | {x['logits_rel']:.2e} | {x['loss_rel']:.2e} "
                         f"| {x['grad_rel_max']:.2e} ({x['grad_tensors']}) "
                         f"| {x.get('our_adapter_in_peft_logits_rel', float('nan')):.2e} |")
        f = r["f32"]
        if max(f["logits_rel"], f["loss_rel"], f["grad_rel_max"],
               f["our_adapter_in_peft_logits_rel"]) > F32_LIMIT:
            ok = False
        if r.get("trained_adapter_in_peft_logits_rel", 0.0) > F32_LIMIT:
            ok = False
    for r in results:
        if "trained_adapter_in_peft_logits_rel" in r:
            lines.append(f"\ntrained adapter ({r['model_type']}) loaded by peft: logits rel "
                         f"{r['trained_adapter_in_peft_logits_rel']:.2e}")
    import peft
    import transformers
    lines.append(f"\ntorch {torch.__version__}, transformers {transformers.__version__}, "
                 f"peft {peft.__version__}, device {args.device}")
    lines.append(f"f32 target <= {F32_LIMIT:g}: {'PASS' if ok else 'FAIL'}")
    table = "\n".join(lines)
    print(table)
    with open(os.path.join(args.out, "parity.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(args.out, "parity.json"), "w") as f:
        json.dump(results, f, indent=2)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
