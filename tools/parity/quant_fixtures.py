#!/usr/bin/env python3
"""Parity fixtures for a compressed base (fp8, NF4): transformers + peft on the dequantised weights.

Writes into OUT/ (tests/fixtures/quant is where tests/worker/quant_parity_test.cc reads them;
$LORASTREAM_QUANT_FIXTURES points it elsewhere):
  model/                 a small random llama in bf16 (hidden 160, intermediate 288: fp8's
                         128x128 tiles are partial on both edges), norms random too
  model-fp8/             the same weights pre-quantised as the official FP8 uploads store them
                         (quant_method "fp8", weight_block_size [128, 128]), quantised HERE from
                         the format's specification (torch's float8_e4m3fn cast)
  model-bnb-nf4/         the same as bitsandbytes' "-bnb-4bit" uploads (NF4, blocks of 64,
                         absmax double-quantised in groups of 256 against the signed dynamic
                         map), quantised HERE from bitsandbytes' definition
  adapter/               a peft LoRA (rank 4, all seven projections, B random)
  tokens.safetensors     input_ids [2, 32] and labels (the first 5 masked)
  reference-CASE.safetensors for CASE in fp8, nf4 (model/ served with --quantize: the
                         dequantised weights come from `lorastream-store dequantize`), fp8-pre,
                         bnb-nf4-pre (the folders above, dequantised HERE by the specification):
                         "logits" [2, 32, vocab], "loss" [1], "grad.<peft key>" for every LoRA
                         A and B, all f32 from transformers + peft in f32 on the CPU; the -pre
                         cases also "dequantized.model.layers.0.<projection>.weight" (bf16), the
                         specification's dequantisation that our expansion must equal bit for bit.
Dequantisation, by the formats' definitions: fp8 bf16(f32(q) * scale_inv[tile]); NF4
bf16(quant_map[code] * absmax), absmax = f32(nested_map[absmax_q] * nested_absmax) + offset.

Usage (torch, transformers, peft, safetensors; a build of lorastream for its dequantise step):
  python3 tools/parity/quant_fixtures.py --bin build/bin --out tests/fixtures/quant
Without torch, it stops at the first step that needs it and says so (exit status 2).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROJECTIONS = ["self_attn." + t for t in TARGETS[:4]] + ["mlp." + t for t in TARGETS[4:]]
# bitsandbytes' get_4bit_type("nf4").
NF4_CODE = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
            -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
            0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
            0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]
FP8_TILE = 128
NF4_BLOCK, NF4_NESTED = 64, 256


def need_torch():
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
        import peft  # noqa: F401
        import safetensors  # noqa: F401
    except ImportError as e:
        print(f"quant_fixtures.py: {e.name} is not installed; the fixtures need torch, "
              f"transformers, peft and safetensors (the CUDA machine has them)", file=sys.stderr)
        sys.exit(2)


def dynamic_map_signed():
    """bitsandbytes' create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8)."""
    import torch
    data = []
    for i in range(7):
        items = 2 ** i + 1
        bounds = torch.linspace(0.1, 1, items, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        data += ((10 ** (-6 + i)) * means).tolist()
        data += (-(10 ** (-6 + i)) * means).tolist()
    data += [0.0, 1.0]
    data += [0.0] * (256 - len(data))
    data.sort()
    return torch.tensor(data, dtype=torch.float32)


def fp8_quantize(w):
    """[out, in] -> (F8_E4M3 weight, f32 scale_inv [ceil(out/128), ceil(in/128)])."""
    import torch
    rows, cols = w.shape
    tr, tc = -(-rows // FP8_TILE), -(-cols // FP8_TILE)
    w = w.float()
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scale = torch.empty(tr, tc, dtype=torch.float32)
    for i in range(tr):
        for j in range(tc):
            tile = w[i * FP8_TILE:(i + 1) * FP8_TILE, j * FP8_TILE:(j + 1) * FP8_TILE]
            amax = tile.abs().max()
            s = amax / 448.0 if amax > 0 else torch.tensor(1.0)
            scale[i, j] = s
            q[i * FP8_TILE:(i + 1) * FP8_TILE, j * FP8_TILE:(j + 1) * FP8_TILE] = \
                (tile / s).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, scale


def fp8_dequantize(q, scale):
    import torch
    rows, cols = q.shape
    s = scale.repeat_interleave(FP8_TILE, 0).repeat_interleave(FP8_TILE, 1)[:rows, :cols]
    return (q.float() * s).to(torch.bfloat16)


def nf4_quantize(w, qmap, nmap):
    """bitsandbytes' 4-bit NF4 with double quantisation: the safetensors entries of one weight."""
    import torch
    flat = w.float().reshape(-1)
    n = flat.numel()
    blocks = -(-n // NF4_BLOCK)
    padded = torch.zeros(blocks * NF4_BLOCK)
    padded[:n] = flat
    absmax = padded.view(blocks, NF4_BLOCK).abs().max(1).values
    normed = padded.view(blocks, NF4_BLOCK) / absmax.clamp_min(1e-30)[:, None]
    codes = (normed.reshape(-1, 1) - qmap[None, :]).abs().argmin(1)[:n].to(torch.uint8)
    if n % 2:
        codes = torch.cat([codes, torch.tensor([7], dtype=torch.uint8)])
    packed = (codes[0::2] << 4) | codes[1::2]
    offset = absmax.mean()
    centred = absmax - offset
    groups = -(-blocks // NF4_NESTED)
    nested = torch.empty(groups)
    absmax_q = torch.empty(blocks, dtype=torch.uint8)
    for g in range(groups):
        part = centred[g * NF4_NESTED:(g + 1) * NF4_NESTED]
        amax = part.abs().max()
        nested[g] = amax
        scaled = part / amax if amax > 0 else part * 0
        absmax_q[g * NF4_NESTED:(g + 1) * NF4_NESTED] = \
            (scaled[:, None] - nmap[None, :]).abs().argmin(1).to(torch.uint8)
    state = json.dumps({"quant_type": "nf4", "blocksize": NF4_BLOCK, "dtype": "bfloat16",
                        "shape": list(w.shape), "nested_blocksize": NF4_NESTED,
                        "nested_dtype": "float32", "nested_offset": offset.item()})
    return {"": packed.view(-1, 1), ".absmax": absmax_q, ".nested_absmax": nested,
            ".quant_map": qmap.clone(), ".nested_quant_map": nmap.clone(),
            ".quant_state.bitsandbytes__nf4": torch.tensor(list(state.encode()), dtype=torch.uint8)}


def nf4_dequantize(entries, shape):
    import torch
    state = json.loads(bytes(entries[".quant_state.bitsandbytes__nf4"].tolist()).decode())
    offset = torch.tensor(state["nested_offset"], dtype=torch.float32)
    packed = entries[""].reshape(-1)
    codes = torch.stack([packed >> 4, packed & 15], 1).reshape(-1).long()
    n = shape[0] * shape[1]
    qabs = entries[".absmax"].long()
    group = torch.arange(qabs.numel()) // NF4_NESTED
    absmax = entries[".nested_quant_map"][qabs] * entries[".nested_absmax"][group]  # f32 product
    absmax = absmax + offset                                                        # then the sum
    per_value = absmax.repeat_interleave(NF4_BLOCK)[:n]
    return (entries[".quant_map"][codes[:n]] * per_value).to(torch.bfloat16).view(shape)


def write_prequantized(model_dir, out_dir, fmt):
    """model_dir's checkpoint with every projection weight pre-quantised; returns the
    specification's dequantisation of each (bf16)."""
    import torch
    from safetensors.torch import load_file, save_file
    os.makedirs(out_dir, exist_ok=True)
    sd = load_file(os.path.join(model_dir, "model.safetensors"))
    qmap = torch.tensor(NF4_CODE, dtype=torch.float32)
    nmap = dynamic_map_signed()
    out, dequantized = {}, {}
    for name, t in sd.items():
        if not any(name.endswith(p + ".weight") for p in PROJECTIONS):
            out[name] = t
            continue
        if fmt == "fp8":
            q, s = fp8_quantize(t)
            out[name], out[name + "_scale_inv"] = q, s
            dequantized[name] = fp8_dequantize(q, s)
        else:
            entries = nf4_quantize(t, qmap, nmap)
            for suffix, v in entries.items():
                out[name + suffix] = v
            dequantized[name] = nf4_dequantize(entries, list(t.shape))
    save_file(out, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = (
        {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
         "weight_block_size": [FP8_TILE, FP8_TILE]} if fmt == "fp8" else
        {"quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False,
         "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
         "bnb_4bit_compute_dtype": "bfloat16", "bnb_4bit_quant_storage": "uint8"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return dequantized


def make_model(out):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig
    kw = dict(hidden_size=160, intermediate_size=288, num_hidden_layers=2, num_attention_heads=5,
              num_key_value_heads=1, vocab_size=256, max_position_embeddings=128,
              rms_norm_eps=1e-5, tie_word_embeddings=False)
    import transformers
    if int(transformers.__version__.split(".")[0]) >= 5:
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    else:
        kw["rope_theta"] = 10000.0
    model = AutoModelForCausalLM.from_config(LlamaConfig(**kw))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.to(torch.bfloat16).save_pretrained(os.path.join(out, "model"), safe_serialization=True)
    return model


def reference(model_dir, weights, adapter_dir, tokens):
    """transformers + peft in f32 on the CPU with `weights` (name -> tensor) replacing the
    checkpoint's: logits, loss and every LoRA gradient."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                attn_implementation="sdpa")
    with torch.no_grad():
        params = dict(base.named_parameters())
        for name, w in weights.items():
            params[name].copy_(w.float())
    model = PeftModel.from_pretrained(base, adapter_dir, is_trainable=True)
    model.train()
    out = model(input_ids=tokens["input_ids"], labels=tokens["labels"])
    out.loss.backward()
    result = {"logits": out.logits.detach().float().contiguous(),
              "loss": out.loss.detach().float().reshape(1)}
    for n, p in model.named_parameters():
        if "lora_" in n and p.grad is not None:
            result["grad." + n.replace(".default.", ".")] = p.grad.detach().float().contiguous()
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", required=True, help="lorastream's build bin/ (lorastream-store)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    need_torch()
    import torch
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file, save_file
    torch.manual_seed(args.seed)
    os.makedirs(args.out, exist_ok=True)
    model_dir = os.path.join(args.out, "model")
    adapter_dir = os.path.join(args.out, "adapter")

    model = make_model(args.out)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                  target_modules=TARGETS, task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    peft_model.save_pretrained(adapter_dir)
    ids = torch.randint(0, 256, (2, 32), dtype=torch.int64)
    labels = ids.clone()
    labels[:, :5] = -100
    tokens = {"input_ids": ids, "labels": labels}
    save_file(tokens, os.path.join(args.out, "tokens.safetensors"))
    del model, peft_model

    ok = True
    work = os.path.join(args.out, ".work")
    shutil.rmtree(work, ignore_errors=True)
    for case in ("fp8", "nf4", "fp8-pre", "bnb-nf4-pre"):
        extra = {}
        if case.endswith("-pre"):
            fmt = case[:-4]
            dequantized = write_prequantized(model_dir, os.path.join(args.out, "model-" + fmt),
                                             "fp8" if fmt == "fp8" else "nf4")
            weights = dequantized
            extra = {"dequantized." + n: w.contiguous() for n, w in dequantized.items()
                     if n.startswith("model.layers.0.")}
        else:
            deq = os.path.join(work, "deq-" + case)
            cmd = [os.path.join(args.bin, "lorastream-store"), "dequantize", model_dir,
                   "--quantize", case, "--out", deq]
            print("+", " ".join(cmd), flush=True)
            subprocess.run(cmd, check=True)
            weights = load_file(os.path.join(deq, "model.safetensors"))
        ref = reference(model_dir, weights, adapter_dir, tokens)
        ref.update(extra)
        save_file(ref, os.path.join(args.out, f"reference-{case}.safetensors"))
        print(f"{case}: loss {ref['loss'].item():.6f}, {sum(k.startswith('grad.') for k in ref)} "
              f"gradients", flush=True)
        ok = ok and all(torch.isfinite(v.float()).all() for k, v in ref.items())
    shutil.rmtree(work, ignore_errors=True)
    import peft
    import transformers
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write("Parity fixtures of a compressed base (fp8, NF4), read by "
                "tests/worker/quant_parity_test.cc.\n"
                f"Made by `python3 tools/parity/quant_fixtures.py --bin BIN --out DIR "
                f"--seed {args.seed}` with torch {torch.__version__}, transformers "
                f"{transformers.__version__}, peft {peft.__version__} (f32, CPU); what each "
                "file holds is in that script's docstring.\n")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
