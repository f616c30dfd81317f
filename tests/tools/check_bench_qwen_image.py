#!/usr/bin/env python3
"""Checks tools/gpu/bench_qwen_image.sh on the CPU (ctest `bench_qwen_image`): with
qwen-image-tiny every lorastream run trains every step and the table has each row, its floors
and the ratios; the peer is either run or said to be skipped; the musubi run trains ours and
says why musubi-tuner's is missing (no offloader file, and no CUDA). Also checks the table's
FLOP count against every linear layer and attention product of a block enumerated one by one,
and its comparison with musubi-tuner's streaming (the ratio, each PCIe floor at the musubi
peer's bandwidth, a failed configuration's error) from the figures a GPU run writes.

Usage: check_bench_qwen_image.py BUILD_DIR
"""
import json
import os
import re
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


def check_musubi_table(tmp):
    """The table's comparison with musubi-tuner from the files a GPU run writes: ours
    (stats_musubi.jsonl, train_musubi.log) and the musubi peer's peer_musubi.json."""
    out = os.path.join(tmp, "musubi_table")
    os.makedirs(out)
    cfg = {"num_layers": 4, "num_attention_heads": 24, "attention_head_dim": 128,
           "joint_attention_dim": 3584, "in_channels": 64, "out_channels": 16, "patch_size": 2}
    json.dump(cfg, open(os.path.join(out, "config.json"), "w"))
    with open(os.path.join(out, "stats_musubi.jsonl"), "w") as f:
        for i, s in enumerate([9.0, 1.0, 1.2, 1.1]):  # the median after 1 warm-up: 1.1
            f.write(json.dumps({"step": i + 1, "step_seconds": s, "tokens": 4096,
                                "h2d_bytes": 4e9, "peak_device_bytes": 3 * 2**30}) + "\n")
    with open(os.path.join(out, "train_musubi.log"), "w") as f:
        f.write("Qwen-Image group: 3 of 4 blocks streamed through 2 slots, 0 taped\n")
    name = "musubi-tuner LoRAStreamOffloader, swap 3 ring 2, checkpointed, SDPA"
    runs = {name: {"config": {"name": name, "checkpointing": True, "sdpa": ""}, "steps": 4,
                   "step_seconds": 2.0, "peak_gib": 3.5, "h2d_bytes": [9e9, 2e9, 2e9, 2e9]},
            name + " cudnn": {"config": {"name": name + " cudnn", "checkpointing": True,
                                         "sdpa": "cudnn"}, "error": "RuntimeError: no kernel"}}
    peer = {"torch": "t", "diffusers": "d", "peft": "p", "device": "GPU", "load_seconds": 1.0,
            "runs": runs, "wall_seconds": 9.0,
            "musubi": {"class": "LoRAStreamOffloader", "offloader": "x.py", "swap": 3,
                       "streamed": 3, "ring": 2, "blocks": 4, "stream_idx": [0, 1, 3],
                       "pinned": True, "block_bytes": 2**30, "h2d_bytes_per_second": 40e9,
                       "streamed_on_host_between_steps": 1}}
    json.dump(peer, open(os.path.join(out, "peer_musubi.json"), "w"))
    table = os.path.join(ROOT, "tools", "gpu", "bench_qwen_image_table.py")
    r = subprocess.run([sys.executable, table, out, "--steps", "4", "--warmup", "1", "--swap",
                        "3"], capture_output=True, text=True, timeout=60)
    row = [line for line in r.stdout.splitlines() if line.startswith("| ours streamed 3/4, ring 2 "
                                                                      "beside")]
    # ours: 1.1 s, 4 GB at 40 GB/s = 0.100 s; theirs: 2.0 s, 2 GB (the median after the
    # warm-up) = 0.050 s; ours / theirs 0.550
    cells = [c.strip() for c in row[0].split("|")[2:-1]] if row else []
    check(cells == ["1.100", "4.00", "0.100", "3.00", "2.000", "2.00", "0.050", "3.50", "0.550",
                    "<= 0.8"], f"the row against musubi-tuner: {cells}")
    check("| 0.550 | <= 0.8 |" in r.stdout and "at its fastest |" in r.stdout,
          "the ratio against musubi-tuner at its fastest, with its target")
    check("SDPA cudnn | 3 of 4 streamed, ring 2, pinned; failed: RuntimeError: no kernel"
          in r.stdout, "a failed musubi-tuner configuration's error")
    os.remove(os.path.join(out, "peer_musubi.json"))
    with open(os.path.join(out, "peer_musubi.log"), "w") as f:
        f.write("Traceback (most recent call last):\nRuntimeError: CUDA out of memory\n\n")
    r = subprocess.run([sys.executable, table, out, "--steps", "4", "--warmup", "1", "--swap",
                        "3"], capture_output=True, text=True, timeout=60)
    check("musubi-tuner's streaming: not run here (failed: RuntimeError: CUDA out of memory"
          in r.stdout and "| 1.100 | 4.00 | — |" in r.stdout,
          "without musubi-tuner's figures: ours, and why theirs are missing")


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
        check_musubi_table(tmp)
        env = dict(os.environ, LORASTREAM_BUILD_DIR=build, QI_BENCH_PRESET="qwen-image-tiny",
                   QI_BENCH_LAYERS="3", QI_BENCH_DEVICE="cpu", QI_BENCH_DTYPE="f32",
                   QI_BENCH_PIXELS="64x64", QI_BENCH_TEXT_TOKENS="8",
                   QI_BENCH_GROUP_PIXELS="32x32", QI_BENCH_BUDGET="1400KiB",
                   QI_BENCH_GROUP_BUDGET="8MiB", QI_BENCH_GROUP="2", QI_BENCH_STEPS="3",
                   QI_BENCH_FP8_BUDGET="1350KiB", QI_BENCH_WARMUP="1",
                   QI_BENCH_PEER_DEADLINE="60",
                   QI_BENCH_RUNS="resident,streamed,fp8,auto,group,peer,musubi",
                   QI_BENCH_MUSUBI=os.path.join(tmp, "no-musubi.py"),
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
                     "lorastream within 1400KiB", "lorastream, fp8 store, within 1350KiB",
                     "lorastream, gpu_memory_budget = \"auto\"",
                     "lorastream, one job at 32x32 within 8MiB",
                     "lorastream, a group of 2 at 32x32 within 8MiB"):
            check(name in rows and "| 3/3 |" in rows[name], f"row {name!r} with 3 of 3 steps")
        streamed = rows.get("lorastream within 1400KiB", "")
        check(" of 3 streamed, ring " in streamed and "| 0 of 3" not in streamed,
              "the budget's plan streams blocks")
        fp8 = rows.get("lorastream, fp8 store, within 1350KiB", "")
        check(" of 3 streamed, ring " in fp8 and "| 0 of 3" not in fp8,
              "the fp8 store's plan within its budget streams blocks")
        check(re.search(r"\| fp8 store within 1350KiB / resident \| [0-9.]+ \|", md) is not None
              and "fp8 store within 1350KiB: peak GiB" in md, "the fp8 store's ratios")
        check(not any(n.startswith("lorastream.qi-bench-fp8-") for n in os.listdir("/dev/shm")),
              "the fp8 store stopped with the script (its segments gone)")
        check("| resident / diffusers + peft" in md, "the like-with-like ratio's line")
        check("group of 2 at 32x32: image tokens/s over one job's" in md
              and "| >= 2 (the target's" in md, "the group's ratio with its target")
        check(re.search(r"\| group of 2: step / its floor, max\(PCIe [0-9.]+ s, compute [0-9.]+ "
                        r"s\) \| [0-9.]+ \| <= 1.05 \|", md) is not None,
              "the group's step over its floor, max(copies, compute)")
        check("diffusers + peft: checkpointed" in md or "Peer (diffusers + peft): not run here"
              in md, "the peer's rows, or why there are none")
        ours = rows.get("lorastream, blocks_to_swap = 2, ring_size = 2 (beside musubi-tuner's)", "")
        check("| 2 of 3 streamed, ring 2" in ours and "| 3/3 |" in ours,
              "the musubi run's row of ours: QI_BENCH_SWAP's default, 2 of 3, with 3 of 3 steps")
        check("musubi-tuner's streaming: not run here (no musubi-tuner offloader at" in md,
              "why musubi-tuner's streaming is missing")
        check("Command: `QI_BENCH_PRESET=qwen-image-tiny" in md, "the command")
    print(f"{len(failures)} failed" if failures else "all passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
