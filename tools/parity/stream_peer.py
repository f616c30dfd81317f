#!/usr/bin/env python3
"""Streaming step: musubi-tuner's H2D-only block swap (its LoRAStreamOffloader, the streaming
peer) driving transformers + peft on the checkpoint lorastream's streaming bench uses, beside
our rows from the same run.

The peer: a Hugging Face checkpoint in bf16 (tools/gpu/bench_stream.sh's 16-layer
llama-3-8b-shaped one), rank-16 peft LoRA on all seven projections, batch 1, the base frozen,
`blocks_to_swap` decoder layers streamed Host->Device by musubi-tuner's LoRAStreamOffloader
(pinned masters, `ring_size` GPU slots), wired as musubi-tuner's own models wire it: the
offloader built on the frozen blocks, `wait_for_block` before each block's forward,
`submit_move_blocks_forward` after it, its backward hooks prefetching during the backward,
each block's forward gradient-checkpointed inside the module (non-reentrant, as its
--block_swap_h2d_only requires). Its step: forward, loss, backward, AdamW, between two device
synchronisations; median of --repeat steps after --warmup. bf16 autocast (the faster of
speed.py's two checkpointed variants at every length there).

musubi-tuner's offloader is not part of this repository: pass its file,
src/musubi_tuner/modules/custom_offloading_utils.py of a checkout of
https://github.com/kohya-ss/musubi-tuner (it needs torch only).

Usage: stream_peer.py --offloader PATH/custom_offloading_utils.py --model-dir CKPT --out DIR
           [--tokens 2048,512] [--swap 12] [--ring 2] [--repeat 6] [--warmup 3]
           [--ours BENCH_OUT/bench_stream.jsonl]
With --ours, the table puts our row of the same plan (blocks_to_swap, ring) next to the peer's.
"""
import argparse
import functools
import gc
import json
import os
import statistics
import sys

import torch
from torch.utils.checkpoint import checkpoint

# tools/parity/speed.py: the peer's model loading, LoRA and timed step, shared.
from speed import dtype_kwarg, peft_lora, timed_steps, write_table

# tools/gpu/bench_common.py: musubi-tuner's offloader, loaded and built as the Qwen-Image
# benchmark's peer builds it.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "gpu"))
from bench_common import load_musubi_offloading, musubi_offloader  # noqa: E402


def checkpointed(forward, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def peer_step_times(offloading, model_dir, tokens, swap, ring, repeat, warmup, device):
    from transformers import AutoModelForCausalLM
    dev = torch.device(device)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, **dtype_kwarg(torch.bfloat16),
                                              attn_implementation="sdpa")
    hf.config.use_cache = False
    for p in hf.parameters():
        p.requires_grad_(False)  # the frozen base the offloader requires
    for module in (hf.model.embed_tokens, hf.model.norm, hf.model.rotary_emb, hf.lm_head):
        module.to(dev)
    layers = list(hf.model.layers)
    # Built before peft wraps the layers' Linear modules (musubi_offloader says why).
    offloader = musubi_offloader(offloading, "llama", layers, swap, ring, dev)
    model = peft_lora(hf)
    for i, layer in enumerate(layers):
        layer.forward = functools.partial(checkpointed, layer.forward)
        layer.register_forward_pre_hook(lambda m, a, i=i: offloader.wait_for_block(i))
        layer.register_forward_hook(
            lambda m, a, o, i=i: offloader.submit_move_blocks_forward(layers, i))
    offloader.prepare_block_devices_before_forward(layers)
    params = [p for p in model.parameters() if p.requires_grad]
    assert params and all(p.device == dev for p in params), "LoRA weights not on the device"
    model.train()
    ids = torch.randint(0, hf.config.vocab_size, (1, tokens), dtype=torch.int64,
                        generator=torch.Generator().manual_seed(tokens)).to(dev)
    times = []
    peak, loss = timed_steps(model, params, ids, repeat, warmup, dev, autocast=True, times=times)
    # Between steps the ring holds its slots' blocks; every other streamed block's weights
    # are the host masters (a check that the peer streams at all).
    streamed_on_host = sum(1 for i in offloader.stream_idx
                           if layers[i].self_attn.q_proj.base_layer.weight.device.type == "cpu")
    result = {"tokens": tokens, "swap": swap, "ring": ring, "median_s": statistics.median(times),
              "step_seconds": times, "peak_bytes": peak, "streamed": offloader.S,
              "streamed_between_steps_on_host": streamed_on_host, "loss": loss}
    del model, params, offloader, hf, layers
    gc.collect()
    torch.cuda.empty_cache()
    return result


def our_rows(path, swap, ring):
    """Our bench's rows of `swap` streamed blocks through a ring of `ring`, by tokens: the
    median step after the bench's warm-ups and the peak (lorastream-bench-stream's jsonl)."""
    label = f"swap {swap} ring {ring}"
    steps, peaks = {}, {}
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if r["mode"] != label:
                continue
            steps.setdefault(r["tokens"], []).append(r["stats"]["step_seconds"])
            peaks[r["tokens"]] = max(peaks.get(r["tokens"], 0), r["stats"]["peak_device_bytes"])
    return steps, peaks


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--offloader", required=True,
                    help="musubi-tuner's src/musubi_tuner/modules/custom_offloading_utils.py")
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default="2048,512")
    ap.add_argument("--swap", type=int, default=12)
    ap.add_argument("--ring", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--ours", default="", help="lorastream-bench-stream's bench_stream.jsonl")
    ap.add_argument("--our-warmup", type=int, default=2, help="the bench's --warmup")
    args = ap.parse_args()
    if args.repeat < 5 or args.warmup < 2:
        ap.error("--repeat must be >= 5 and --warmup >= 2")
    os.makedirs(args.out, exist_ok=True)
    offloading = load_musubi_offloading(args.offloader)
    rows = []
    for n in [int(x) for x in args.tokens.split(",")]:
        r = peer_step_times(offloading, args.model_dir, n, args.swap, args.ring, args.repeat,
                            args.warmup, args.device)
        print(f"musubi-tuner LoRAStreamOffloader, {n} tokens, swap {args.swap} ring {args.ring}: "
              f"median {r['median_s'] * 1e3:.1f} ms, peak {r['peak_bytes'] / 2**30:.2f} GiB, "
              f"{r['streamed_between_steps_on_host']} of {r['streamed']} streamed blocks' "
              f"weights on the host", flush=True)
        rows.append(r)
    with open(os.path.join(args.out, "stream_peer.json"), "w") as f:
        json.dump(rows, f, indent=2)

    steps, peaks = our_rows(args.ours, args.swap, args.ring) if args.ours else ({}, {})
    lines = [f"| tokens | plan | ours: ms (peak GiB) | musubi-tuner: ms (peak GiB) | ours / theirs |",
             "| --- | --- | --- | --- | --- |"]
    for r in rows:
        # The bench's median of an even count is the upper of the middle two: its table's figure.
        mine = sorted(steps.get(r["tokens"], [])[args.our_warmup:])
        ours_s = mine[len(mine) // 2] if mine else None
        ours_cell = (f"{ours_s * 1e3:.1f} ({peaks[r['tokens']] / 2**30:.2f})" if ours_s
                     else "-")
        ratio = f"**{ours_s / r['median_s']:.3f}**" if ours_s else "-"
        lines.append(f"| {r['tokens']} | {args.swap} of the blocks streamed, ring {args.ring} "
                     f"| {ours_cell} | {r['median_s'] * 1e3:.1f} ({r['peak_bytes'] / 2**30:.2f}) "
                     f"| {ratio} |")
    write_table(lines, os.path.join(args.out, "stream_peer.md"))


if __name__ == "__main__":
    main()
