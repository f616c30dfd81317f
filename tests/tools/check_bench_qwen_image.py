#!/usr/bin/env python3
"""Checks tools/gpu/bench_qwen_image.sh on the CPU (ctest `bench_qwen_image`): with
qwen-image-tiny every lorastream run trains every step and the table has each row, its floors
and the ratios; the peer is either run or said to be skipped. Also checks the table's FLOP
count against every linear layer and attention product of a block enumerated one by one.

Usage: check_bench_qwen_image.py BUILD_DIR
"""
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools", "gpu"))
from bench_qwen_image_table import image_tokens, step_flops  # noqa: E402

failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        failures.append(what)


def enumerated_flops(cfg, img, txt, rank, checkpointed):
    """The same step's FLOPs from each layer's own shape (no shortcut of 12 D^2 or 18 D)."""
    d = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    n = img + txt
    fwd = bwd = 0.0
    for tokens in (img, txt):  # the image stream's layers, then the text stream's
        for fan_in, fan_out in [(d, d)] * 4 + [(d, 4 * d), (4 * d, d)]:  # q k v out, MLP
            fwd += 2 * fan_in * fan_out * tokens + 2 * rank * (fan_in + fan_out) * tokens
            bwd += 2 * fan_in * fan_out * tokens + 2 * 2 * rank * (fan_in + fan_out) * tokens
    heads, hd = cfg["num_attention_heads"], cfg["attention_head_dim"]
    fwd += heads * (2 * n * n * hd) * 2  # scores and the weighted sum, per head
    bwd += heads * (2 * n * n * hd) * 5  # dV, dP, dQ, dK and the scores again
    block = fwd * (2 if checkpointed else 1) + bwd
    out = cfg["patch_size"] ** 2 * cfg["out_channels"]
    rest = (2 * cfg["in_channels"] * d * img + 2 * cfg["joint_attention_dim"] * d * txt
            + 2 * 2 * d * out * img)
    return cfg["num_layers"] * block + rest


def main():
    build = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "build")
    qwen = {"num_layers": 60, "num_attention_heads": 24, "attention_head_dim": 128,
            "joint_attention_dim": 3584, "in_channels": 64, "out_channels": 16, "patch_size": 2}
    check(image_tokens("1024x1024") == 4096 and image_tokens("512x768") == 1536,
          "image tokens: (W/16)(H/16)")
    for ckpt in (True, False):
        a = step_flops(qwen, 4096, 256, 16, ckpt)
        b = enumerated_flops(qwen, 4096, 256, 16, ckpt)
        check(abs(a - b) <= 1e-9 * b, f"FLOPs, checkpointed={ckpt}: {a:.4e} = {b:.4e} enumerated")
    check(step_flops(qwen, 4096, 256, 16, True) > step_flops(qwen, 4096, 256, 16, False),
          "the recompute costs FLOPs")

    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, LORASTREAM_BUILD_DIR=build, QI_BENCH_PRESET="qwen-image-tiny",
                   QI_BENCH_LAYERS="3", QI_BENCH_DEVICE="cpu", QI_BENCH_DTYPE="f32",
                   QI_BENCH_PIXELS="64x64", QI_BENCH_TEXT_TOKENS="8",
                   QI_BENCH_GROUP_PIXELS="32x32", QI_BENCH_BUDGET="1400KiB",
                   QI_BENCH_GROUP_BUDGET="8MiB", QI_BENCH_GROUP="2", QI_BENCH_STEPS="3",
                   QI_BENCH_WARMUP="1", QI_BENCH_PEER_DEADLINE="60",
                   QI_BENCH_WORK=os.path.join(tmp, "work"))
        r = subprocess.run([os.path.join(ROOT, "tools", "gpu", "bench_qwen_image.sh"),
                            os.path.join(tmp, "out")], env=env, capture_output=True, text=True,
                           timeout=600)
        print(r.stdout[-4000:], r.stderr[-2000:])
        check(r.returncode == 0, f"bench_qwen_image.sh exits 0 (got {r.returncode})")
        md_path = os.path.join(tmp, "out", "qwen_image", "bench_qwen_image.md")
        md = open(md_path).read() if os.path.exists(md_path) else ""
        rows = {line.split("|")[1].strip(): line for line in md.splitlines()
                if line.startswith("| lorastream")}
        for name in ("lorastream resident (blocks_to_swap = 0, checkpointed)",
                     "lorastream within 1400KiB", "lorastream, gpu_memory_budget = \"auto\"",
                     "lorastream, one job at 32x32 within 8MiB",
                     "lorastream, a group of 2 at 32x32 within 8MiB"):
            check(name in rows and "| 3/3 |" in rows[name], f"row {name!r} with 3 of 3 steps")
        streamed = rows.get("lorastream within 1400KiB", "")
        check(" of 3 streamed, ring " in streamed and "| 0 of 3" not in streamed,
              "the budget's plan streams blocks")
        check("| resident / diffusers + peft" in md, "the like-with-like ratio's line")
        check("group of 2 at 32x32: image tokens/s over one job's" in md, "the group's ratio")
        check("diffusers + peft: checkpointed" in md or "Peer (diffusers + peft): not run here"
              in md, "the peer's rows, or why there are none")
        check("Command: `QI_BENCH_PRESET=qwen-image-tiny" in md, "the command")
    print(f"{len(failures)} failed" if failures else "all passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
