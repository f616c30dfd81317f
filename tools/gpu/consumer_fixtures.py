#!/usr/bin/env python3
"""Fixtures that prove the consumers of our LLM adapters load them (issue 40).

Reads tests/fixtures/consumers/llm/ (made by our code and committed: model/, a tiny Llama in
bf16; adapter/, our peft folder; tokens.safetensors) and writes beside them:
  peft_logits.safetensors  "logits" [2, 16, vocab] f32: transformers' model (f32, TF32 off)
                           with PeftModel.from_pretrained(model, adapter/) on input_ids
  consumers.json           versions, and with --llama-cpp DIR (a llama.cpp checkout: its
                           convert_lora_to_gguf.py and gguf-py/) the conversion's return code,
                           log tail and the GGUF's tensor names (written last)
and, with diffusers importable (v0.39.0's src/ on PYTHONPATH), from
tests/fixtures/consumers/flux/ (our adapter files for tests/fixtures/flux/flux_d1s2_model,
made by our code and committed) into the same folder:
  diffusers_output.safetensors  "from_diffusers_file" / "from_kohya_file": the transformer's
                           output on flux_d1s2_case's inputs after FluxPipeline's
                           lora_state_dict + load_lora_into_transformer (what load_lora_weights
                           runs) read pytorch_lora_weights.safetensors / adapter_kohya.safetensors
  flux_consumers.json      versions, what loaded, errors (written last)
and from tests/fixtures/consumers/qwen_image/ (our two files for
tests/fixtures/qwen_image/qi_l2_model, made by our code and committed) into the same folder:
  diffusers_output.safetensors  "from_diffusers_file" / "from_comfy_file": diffusers'
                           QwenImageTransformer2DModel (qi_l2_model's weights) on qi_l2_case's
                           inputs after QwenImagePipeline's lora_state_dict +
                           load_lora_into_transformer (what load_lora_weights runs) read
                           pytorch_lora_weights.safetensors / adapter_comfyui.safetensors;
                           "without_adapter": the same model with no LoRA
  qwen_image_consumers.json  versions, per file what loaded (keys read, LoRA weights set, keys
                           left unloaded, scalings, the adapter's effect) or the error (written
                           last)
tests/worker/consumer_fixtures_test.cc compares on the CPU. Commit the files written.

Usage (torch, transformers, peft, safetensors installed; no network needed):
  PYTHONPATH=.diffusers/src python3 tools/gpu/consumer_fixtures.py [--llama-cpp DIR]
      [--only llm|flux|qwen_image ...]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM


def dtype_kwarg(dtype):
    """transformers >= 4.56 calls it `dtype` (5.x drops `torch_dtype`)."""
    import transformers
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}


def peft_logits(d):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = AutoModelForCausalLM.from_pretrained(os.path.join(d, "model"),
                                                 **dtype_kwarg(torch.float32))
    model = PeftModel.from_pretrained(model, os.path.join(d, "adapter"))
    model.eval()
    ids = load_file(os.path.join(d, "tokens.safetensors"))["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float().contiguous()
    save_file({"logits": logits}, os.path.join(d, "peft_logits.safetensors"))
    return list(logits.shape)


def llama_cpp(d, root):
    """convert_lora_to_gguf.py --base model/ adapter/; the GGUF's tensor names."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "adapter.gguf")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.path.join(root, "gguf-py") + os.pathsep + env.get("PYTHONPATH", "")
        cmd = [sys.executable, os.path.join(root, "convert_lora_to_gguf.py"), "--base",
               os.path.join(d, "model"), "--outtype", "f32", "--outfile", out,
               os.path.join(d, "adapter")]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
        result = {"command": " ".join(cmd[1:]), "returncode": p.returncode,
                  "log_tail": (p.stdout + p.stderr)[-4000:], "tensors": []}
        if p.returncode == 0:
            sys.path.insert(0, os.path.join(root, "gguf-py"))
            from gguf import GGUFReader
            reader = GGUFReader(out)
            result["tensors"] = sorted(t.name for t in reader.tensors)
            for field in reader.fields.values():
                if field.name == "adapter.lora.alpha":
                    result["lora_alpha"] = float(field.parts[field.data[0]][0])
        return result


def write_diffusers_results(d, outputs, report, report_name):
    """d/diffusers_output.safetensors (if anything ran), then the report with versions, last."""
    import diffusers
    import peft
    if outputs:
        save_file(outputs, os.path.join(d, "diffusers_output.safetensors"))
    report.update({"diffusers": diffusers.__version__, "peft": peft.__version__,
                   "torch": torch.__version__})
    with open(os.path.join(d, report_name), "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    return report


def flux_diffusers(root):
    """diffusers loads our two FLUX files into flux_d1s2's transformer; its outputs."""
    import traceback
    sys.path.insert(0, os.path.join(root, "tools", "parity"))
    import flux_fixtures as ff
    from diffusers import FluxPipeline, FluxTransformer2DModel
    d = os.path.join(root, "tests", "fixtures", "consumers", "flux")
    model_file = os.path.join(root, "tests", "fixtures", "flux", "flux_d1s2_model.safetensors")
    case = load_file(os.path.join(root, "tests", "fixtures", "flux", "flux_d1s2_case.safetensors"))
    cfg = ff.CONFIGS["flux_d1s2"]

    def base_model():
        # flux_fixtures.make_case's model (seed 100 for flux_d1s2), checked against the file.
        torch.manual_seed(100)
        model = FluxTransformer2DModel(**ff.COMMON, **cfg).to(torch.float32)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "norm_q" in n or "norm_k" in n or "norm_added" in n:
                    p.add_(0.1 * torch.randn_like(p))
        bfl = ff.bfl_from_diffusers(model.state_dict(), cfg["num_layers"],
                                    cfg["num_single_layers"])
        ref = load_file(model_file)
        assert set(bfl) == set(ref), "the rebuilt model's tensors differ from the file's"
        worst = max(float((bfl[k].float() - ref[k].float()).abs().max()) for k in ref)
        assert worst == 0.0, f"the rebuilt model differs from {model_file} by {worst}"
        return model.eval()

    outputs, report = {}, {}
    for key, file in [("from_diffusers_file", "pytorch_lora_weights.safetensors"),
                      ("from_kohya_file", "adapter_kohya.safetensors")]:
        try:
            model = base_model()
            # v0.39 returns the state dict alone unless return_alphas asks for the pair.
            loaded = FluxPipeline.lora_state_dict(os.path.join(d, file), return_alphas=True)
            state_dict, alphas = (loaded[0], loaded[1]) if isinstance(loaded, tuple) else (loaded, None)
            FluxPipeline.load_lora_into_transformer(state_dict, network_alphas=alphas,
                                                    transformer=model)
            with torch.no_grad():
                out = model(hidden_states=case["img"], encoder_hidden_states=case["txt"],
                            pooled_projections=case["y"], timestep=case["timesteps"],
                            img_ids=case["img_ids"][0], txt_ids=case["txt_ids"][0],
                            guidance=case["guidance"], return_dict=False)[0]
            outputs[key] = out.float().contiguous()
            report[key] = {"file": file, "keys": len(state_dict), "ok": True}
        except Exception:
            report[key] = {"file": file, "ok": False, "error": traceback.format_exc()[-3000:]}
    return write_diffusers_results(d, outputs, report, "flux_consumers.json")


def qwen_image_diffusers(root):
    """diffusers loads our two Qwen-Image files into qi_l2's transformer; its outputs."""
    import traceback
    from diffusers import QwenImagePipeline, QwenImageTransformer2DModel
    sys.path.insert(0, os.path.join(root, "tools", "parity"))
    import qwen_image_fixtures as qf
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    d = os.path.join(root, "tests", "fixtures", "consumers", "qwen_image")
    fixtures = os.path.join(root, "tests", "fixtures", "qwen_image")
    weights = load_file(os.path.join(fixtures, "qi_l2_model.safetensors"))
    case = load_file(os.path.join(fixtures, "qi_l2_case.safetensors"))
    layers = qf.CASES["qi_l2"]["layers"]
    assert float(case["use_mask"][0]) < 0.5, "qi_l2's caption is unpadded: no mask"
    grid_h, grid_w = (int(x) for x in case["grid"].tolist())
    batch = case["img"].shape[0]

    def base_model():
        # qwen_image_fixtures.make_case's model: its config and the file's weights (bare names).
        model = QwenImageTransformer2DModel(num_layers=layers, **qf.COMMON).to(torch.float32)
        model.load_state_dict(weights, strict=True)
        return model.eval()

    def forward(model):
        with torch.no_grad():
            out = model(hidden_states=case["img"], encoder_hidden_states=case["txt"],
                        encoder_hidden_states_mask=None, timestep=case["timesteps"],
                        img_shapes=[(1, grid_h, grid_w)] * batch, return_dict=False)[0]
        return out.float().contiguous()

    without = forward(base_model())
    outputs, report = {}, {}
    for key, file in [("from_diffusers_file", "pytorch_lora_weights.safetensors"),
                      ("from_comfy_file", "adapter_comfyui.safetensors")]:
        try:
            model = base_model()
            # QwenImagePipeline.load_lora_weights' steps, the pipeline's other parts aside.
            state_dict, metadata = QwenImagePipeline.lora_state_dict(
                os.path.join(d, file), return_lora_metadata=True)
            if not all("lora" in k for k in state_dict):
                raise ValueError("Invalid LoRA checkpoint: a key without 'lora' (load_lora_weights "
                                 "refuses it)")
            QwenImagePipeline.load_lora_into_transformer(state_dict, transformer=model,
                                                         metadata=metadata)
            adapters = list(getattr(model, "peft_config", {}))
            if len(adapters) != 1:
                raise RuntimeError(f"expected one adapter in the transformer, found {adapters}")
            name = adapters[0]
            # What the transformer holds: its LoRA parameters under the file's (converted) keys.
            held = {}
            for n, p in model.named_parameters():
                if f".{name}." in n and (".lora_A." in n or ".lora_B." in n):
                    held["transformer." + n.replace(f".{name}.", ".")] = p.detach()
            unloaded = sorted(k for k in state_dict if k not in held)
            not_in_file = sorted(k for k in held if k not in state_dict)
            worst = max((float((held[k].float() - v.float()).abs().max())
                         for k, v in state_dict.items() if k in held), default=None)
            scalings = sorted({float(m.scaling[name]) for m in model.modules()
                               if isinstance(getattr(m, "scaling", None), dict)
                               and name in m.scaling})
            out = forward(model)
            outputs[key] = out
            effect = float((out - without).abs().max() / without.abs().max())
            report[key] = {"file": file, "ok": True, "keys": len(state_dict),
                           "loaded": len(state_dict) - len(unloaded), "unloaded": unloaded,
                           "not_in_file": not_in_file, "max_value_diff": worst,
                           "scalings": scalings, "adapter": name,
                           "metadata": metadata is not None,
                           "effect_vs_no_adapter": effect}
        except Exception:
            report[key] = {"file": file, "ok": False, "error": traceback.format_exc()[-3000:]}
    outputs["without_adapter"] = without
    return write_diffusers_results(d, outputs, report, "qwen_image_consumers.json")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.abspath(os.path.join(here, "..", ".."))
    ap.add_argument("--dir", default=os.path.join(root, "tests", "fixtures", "consumers", "llm"))
    ap.add_argument("--llama-cpp", default="", help="a llama.cpp checkout (optional)")
    ap.add_argument("--only", choices=["llm", "flux", "qwen_image"], action="append",
                    help="make only these parts' outputs (repeatable; all by default)")
    a = ap.parse_args()
    parts = set(a.only or ["llm", "flux", "qwen_image"])
    summary = None
    if "llm" in parts:
        d = os.path.abspath(a.dir)
        import peft
        import transformers
        summary = {"torch": torch.__version__, "transformers": transformers.__version__,
                   "peft": peft.__version__, "peft_logits_shape": peft_logits(d),
                   "llama_cpp": llama_cpp(d, os.path.abspath(a.llama_cpp)) if a.llama_cpp
                   else None}
        with open(os.path.join(d, "consumers.json"), "w") as f:
            json.dump(summary, f, indent=2)
            f.write("\n")
        print(json.dumps({k: v for k, v in summary.items() if k != "llama_cpp"}, indent=2))
    diffusion = [(name, make) for name, make in [("flux", flux_diffusers),
                                                 ("qwen_image", qwen_image_diffusers)]
                 if name in parts]
    try:
        import diffusers  # noqa: F401
        have_diffusers = True
    except ImportError:
        have_diffusers = False
    for name, make in diffusion:
        if not have_diffusers:
            print(f"diffusers: not importable (put v0.39.0's src/ on PYTHONPATH): {name} skipped")
            continue
        report = make(root)
        print(f"diffusers {name}:",
              {k: v.get("ok") for k, v in report.items() if isinstance(v, dict)})
    if summary and summary["llama_cpp"]:
        print("llama.cpp: return code", summary["llama_cpp"]["returncode"], "-",
              len(summary["llama_cpp"]["tensors"]), "tensors")


if __name__ == "__main__":
    main()
