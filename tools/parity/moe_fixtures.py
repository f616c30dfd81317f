#!/usr/bin/env python3
"""Mixture-of-experts parity fixtures from transformers' Qwen3MoeForCausalLM and
MixtralForCausalLM with peft LoRA on the attention projections and every expert.

Writes, per small random config NAME (qwen3_moe, mixtral), into OUT/ (flat: the device
tool brings back files, not folders):
  NAME_config.json, NAME_model.safetensors
                       the model as save_pretrained writes it: per-expert tensors, as on the
                       Hub (Qwen3-MoE: mlp.gate, mlp.experts.E.{gate,up,down}_proj; Mixtral:
                       block_sparse_moe.gate, block_sparse_moe.experts.E.w1/w2/w3), although
                       transformers 5 fuses them into 3-D gate_up_proj/down_proj in memory
                       (were they written fused, they are split back here; the json says)
  NAME_adapter_config.json, NAME_adapter_model.safetensors
                       a per-expert peft adapter (target_modules q/k/v/o_proj and the expert
                       projections; every A and B random), as peft wrote it for per-expert
                       nn.Linear experts; peft 0.21 loads it into transformers 5's fused
                       experts by its own conversion (PeftModel.from_pretrained below)
  NAME_case.safetensors
                       input_ids, labels [2, 12] (the first 3 labels -100), transformers'
                       logits, its loss and every LoRA gradient as grad.<per-expert peft key>,
                       folded back from peft's fused tensors (the layout is checked against the
                       loaded values first: layout_ok in the json)
And OUT/moe_fixtures.json (written last): versions, keys, peft's config after loading, the
routing margin (the smallest gap between the k-th and (k+1)-th router logit) and what peft
wraps for target_modules gate_proj/up_proj/down_proj on a fresh transformers 5 model.
All in f32 on the CPU (eager attention); tests/worker/moe_test.cc compares at 1e-4.

Usage (torch, transformers 5, peft, safetensors installed):
  python3 tools/parity/moe_fixtures.py --out tests/fixtures/moe
On the CUDA machine through the device tool, which brings back at most a few files, pack them:
  python3 tools/parity/moe_fixtures.py --out $OUT/moe && tar -C $OUT -cf $OUT/moe.tar moe
"""
import argparse
import json
import os
import shutil
import sys
import traceback

import torch
from safetensors.torch import load_file, save_file

RANK, ALPHA = 4, 8.0
SEQ = 12

COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=64, rms_norm_eps=1e-6,
              rope_theta=10000.0, tie_word_embeddings=False, num_experts_per_tok=2,
              output_router_logits=False, hidden_act="silu")

CONFIGS = {
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=4, moe_intermediate_size=16,
                      intermediate_size=48, norm_topk_prob=True, decoder_sparse_step=1,
                      mlp_only_layers=[], attention_bias=False, use_sliding_window=False),
    "mixtral": dict(model_type="mixtral", num_local_experts=4, intermediate_size=16,
                    sliding_window=None),
}


def per_expert(sd, model_type, num_experts, inter):
    """transformers 5's fused expert tensors -> the Hub's per-expert names (the inverse of
    its conversion mapping: gate_up_proj [E, 2I, H] = cat(gate, up) per expert, down_proj
    [E, H, I])."""
    out = {}
    for k, v in sd.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            pre = k[: -len("mlp.experts.gate_up_proj")]
            for e in range(num_experts):
                g, u = v[e][:inter], v[e][inter:]
                if model_type == "mixtral":
                    out[f"{pre}block_sparse_moe.experts.{e}.w1.weight"] = g.contiguous()
                    out[f"{pre}block_sparse_moe.experts.{e}.w3.weight"] = u.contiguous()
                else:
                    out[f"{pre}mlp.experts.{e}.gate_proj.weight"] = g.contiguous()
                    out[f"{pre}mlp.experts.{e}.up_proj.weight"] = u.contiguous()
        elif k.endswith("mlp.experts.down_proj"):
            pre = k[: -len("mlp.experts.down_proj")]
            for e in range(num_experts):
                name = (f"{pre}block_sparse_moe.experts.{e}.w2.weight" if model_type == "mixtral"
                        else f"{pre}mlp.experts.{e}.down_proj.weight")
                out[name] = v[e].contiguous()
        elif model_type == "mixtral" and ".mlp.gate." in k:
            out[k.replace(".mlp.gate.", ".block_sparse_moe.gate.")] = v.contiguous()
        else:
            out[k] = v.contiguous()
    return out


def probe_target_modules(cfg):
    """Which modules peft wraps for target_modules gate_proj/up_proj/down_proj."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    try:
        m = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
        pm = get_peft_model(m, LoraConfig(r=RANK, lora_alpha=ALPHA,
                                          target_modules=["gate_proj", "up_proj", "down_proj"]))
        return sorted({n for n, _ in pm.named_parameters() if "lora_" in n})[:8]
    except Exception as e:  # noqa: BLE001 - the fact is what we record
        return "error: " + repr(e)[:400]


def expert_names(model_type):
    """(module prefix of the experts in the Hub checkpoint, gate, up, down) per model type."""
    if model_type == "mixtral":
        return "block_sparse_moe", "w1", "w3", "w2"
    return "mlp", "gate_proj", "up_proj", "down_proj"


def make_case(name, extra, out_dir, seed):
    from peft import LoraConfig, PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(COMMON)
    kw.update(extra)
    model_type = kw.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **kw)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.8, 1.2)
            elif n.endswith("mlp.gate.weight"):
                p.normal_(0, 0.3)
            else:
                p.normal_(0, 0.1)
    model.eval()
    tmp = os.path.join(out_dir, f"_{name}_saved")
    model.save_pretrained(tmp, safe_serialization=True)
    saved = {}
    for f in sorted(os.listdir(tmp)):
        if f.endswith(".safetensors"):
            saved.update(load_file(os.path.join(tmp, f)))
    saved_fused = any(k.endswith("experts.gate_up_proj") for k in saved)
    num_experts = extra.get("num_experts", extra.get("num_local_experts"))
    inter = extra["moe_intermediate_size"] if model_type == "qwen3_moe" else extra["intermediate_size"]
    hub = per_expert(saved, model_type, num_experts, inter) if saved_fused else saved
    shutil.copy(os.path.join(tmp, "config.json"), os.path.join(out_dir, f"{name}_config.json"))
    save_file(hub, os.path.join(out_dir, f"{name}_model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(tmp)

    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, cfg.vocab_size, (2, SEQ), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100

    # The adapter per expert, as peft wrote it for per-expert nn.Linear experts (transformers 4)
    # and as peft 0.21 converts it on load into transformers 5's fused experts.
    mod, gname, uname, dname = expert_names(model_type)
    H, E, L = cfg.hidden_size, num_experts, cfg.num_hidden_layers
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    shapes = {"self_attn.q_proj": (H, q), "self_attn.k_proj": (H, kv), "self_attn.v_proj": (H, kv),
              "self_attn.o_proj": (q, H)}
    for e in range(E):
        shapes[f"{mod}.experts.{e}.{gname}"] = (H, inter)
        shapes[f"{mod}.experts.{e}.{uname}"] = (H, inter)
        shapes[f"{mod}.experts.{e}.{dname}"] = (inter, H)
    ad = {}
    for i in range(L):
        for m, (fin, fout) in shapes.items():
            pre = f"base_model.model.model.layers.{i}.{m}"
            ad[pre + ".lora_A.weight"] = (torch.rand(RANK, fin, generator=g) * 0.2 - 0.1)
            ad[pre + ".lora_B.weight"] = (torch.rand(fout, RANK, generator=g) * 0.2 - 0.1)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", gname, uname, dname]
    adir = os.path.join(out_dir, f"_{name}_adapter")
    LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=targets,
               task_type="CAUSAL_LM").save_pretrained(adir)
    save_file(ad, os.path.join(adir, "adapter_model.safetensors"), metadata={"format": "pt"})
    shutil.copy(os.path.join(adir, "adapter_config.json"),
                os.path.join(out_dir, f"{name}_adapter_config.json"))
    shutil.copy(os.path.join(adir, "adapter_model.safetensors"),
                os.path.join(out_dir, f"{name}_adapter_model.safetensors"))

    pm = PeftModel.from_pretrained(model, adir, is_trainable=True)
    shutil.rmtree(adir)
    pm.train()
    out = pm(input_ids=ids, labels=labels)
    out.loss.backward()

    # peft's fused tensors, named without the adapter name, and their gradients
    fused = {}
    for n, p in pm.named_parameters():
        if "lora_" in n:
            key = n.replace(".default", "")
            fused[key] = p.detach().clone()
            fused["grad." + key] = p.grad.detach().clone()

    # Every per-expert factor inside peft's fused ones, as peft 0.21's conversion lays them
    # out (MergeModulelist, Concatenate and a block-diagonal B for gate_up; FlattenDims, and
    # B's columns rank-major: column rho * E + e): checked against the loaded values, then
    # used to fold the fused gradients back onto the per-expert keys.
    grads, layout_ok = {}, True
    for i in range(L):
        pre = f"base_model.model.model.layers.{i}"
        for m in ("q_proj", "k_proj", "v_proj", "o_proj"):
            for f in ("lora_A", "lora_B"):
                k = f"{pre}.self_attn.{m}.{f}.weight"
                layout_ok &= torch.equal(fused[k], ad[k])
                grads["grad." + k] = fused["grad." + k]
        ex = f"{pre}.mlp.experts"
        gu_a, gu_b = f"{ex}.base_layer.lora_A.weight", f"{ex}.base_layer.lora_B.weight"
        dn_a, dn_b = f"{ex}.lora_A.weight", f"{ex}.lora_B.weight"
        if gu_a not in fused or dn_a not in fused:
            raise RuntimeError("peft's expert keys are not where expected: " +
                               ", ".join(k for k in fused if ".layers.0." in k))
        r2 = fused[gu_a].shape[0] // E
        A_gu = fused[gu_a].view(E, r2, H)
        B_gu = fused[gu_b].view(2 * inter, r2, E)
        A_dn = fused[dn_a].view(E, RANK, inter)
        B_dn = fused[dn_b].view(H, RANK, E)
        gA_gu = fused["grad." + gu_a].view(E, r2, H)
        gB_gu = fused["grad." + gu_b].view(2 * inter, r2, E)
        gA_dn = fused["grad." + dn_a].view(E, RANK, inter)
        gB_dn = fused["grad." + dn_b].view(H, RANK, E)
        for e in range(E):
            base = f"{pre}.{mod}.experts.{e}"
            parts = [(gname, slice(0, RANK), slice(0, inter)),
                     (uname, slice(RANK, 2 * RANK), slice(inter, 2 * inter))]
            for pname, rs, os_ in parts:
                k = f"{base}.{pname}"
                layout_ok &= torch.equal(A_gu[e, rs], ad[k + ".lora_A.weight"])
                layout_ok &= torch.equal(B_gu[os_, rs, e], ad[k + ".lora_B.weight"])
                grads[f"grad.{k}.lora_A.weight"] = gA_gu[e, rs].contiguous()
                grads[f"grad.{k}.lora_B.weight"] = gB_gu[os_, rs, e].contiguous()
            k = f"{base}.{dname}"
            layout_ok &= torch.equal(A_dn[e], ad[k + ".lora_A.weight"])
            layout_ok &= torch.equal(B_dn[:, :, e], ad[k + ".lora_B.weight"])
            grads[f"grad.{k}.lora_A.weight"] = gA_dn[e].contiguous()
            grads[f"grad.{k}.lora_B.weight"] = gB_dn[:, :, e].contiguous()

    # routing margin: the smallest gap between the k-th and (k+1)-th router logits
    margins = []

    def hook(mod_, inp, outp):
        x = inp[0].reshape(-1, inp[0].shape[-1])
        logits = torch.nn.functional.linear(x, mod_.weight).float()
        top = torch.topk(logits, cfg.num_experts_per_tok + 1, dim=-1).values
        margins.append(float((top[:, -2] - top[:, -1]).min()))

    hs = [m.register_forward_hook(hook) for n, m in pm.named_modules()
          if n.endswith("mlp.gate") and hasattr(m, "weight")]
    with torch.no_grad():
        pm(input_ids=ids)
    for h in hs:
        h.remove()

    case = {"input_ids": ids, "labels": labels, "logits": out.logits.detach().contiguous(),
            "loss": out.loss.detach().reshape(1)}
    case.update(grads)
    if not layout_ok:  # keep peft's own tensors, to be read by hand
        case.update({"peft." + k: v.contiguous() for k, v in fused.items()})
    save_file(case, os.path.join(out_dir, f"{name}_case.safetensors"))
    return {
        "model_type": model_type,
        "save_pretrained_fused_experts": saved_fused,
        "hub_keys_block0": sorted(k for k in hub if ".layers.0." in k),
        "peft_fused_keys_block0": {k: list(v.shape) for k, v in fused.items()
                                   if ".layers.0." in k and not k.startswith("grad.")},
        "peft_config_after_load": {
            k: (sorted(v) if isinstance(v, (set, list)) else v)
            for k, v in pm.peft_config["default"].to_dict().items()
            if k in ("target_modules", "target_parameters", "rank_pattern", "alpha_pattern", "r",
                     "lora_alpha")},
        "layout_ok": bool(layout_ok),
        "loss": float(out.loss),
        "routing_margin_logits": min(margins) if margins else None,
        "target_modules_probe": probe_target_modules(cfg),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(8)
    torch.backends.cuda.matmul.allow_tf32 = False
    os.makedirs(args.out, exist_ok=True)
    import peft
    import transformers
    report = {"torch": torch.__version__, "transformers": transformers.__version__,
              "peft": peft.__version__, "rank": RANK, "alpha": ALPHA, "cases": {}}
    for i, (name, extra) in enumerate(CONFIGS.items()):
        try:
            report["cases"][name] = make_case(name, extra, args.out, 1000 + i)
        except Exception:  # noqa: BLE001 - reported, the other case still runs
            report["cases"][name] = {"error": traceback.format_exc()[-3000:]}
    with open(os.path.join(args.out, "moe_fixtures.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report, indent=1))
    return 0 if all("error" not in c for c in report["cases"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
