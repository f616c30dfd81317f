#!/usr/bin/env python3
"""The table of tools/gpu/bench_qwen_image.sh: reads OUT/qwen_image/stats_NAME.jsonl (each job's
per-step statistics), train_LABEL.log (the plan the worker chose: its "Qwen-Image group" line,
the H2D bandwidth its calibration measured and the plan-summary of a budget's plan),
config.json (the checkpoint's shape), peer.json (diffusers + peft) or peer_skipped.txt, and
peer_musubi.json (diffusers + peft streamed by musubi-tuner's LoRAStreamOffloader), else
musubi_skipped.txt or the end of peer_musubi.log, and prints markdown: per run the median step
after the warm-up steps, image tokens/s, the bytes copied per step and the plan's PCIe floor,
the peak device memory beside the plan's estimate, and the compute floor of the step; the
peers' configurations; our streamed-by-hand run beside musubi-tuner's of the same blocks_to_swap
(each PCIe floor its bytes copied per step / the pinned H2D bandwidth the musubi peer measured,
else the one our streamed run's calibration measured); then the ratios the Qwen-Image targets
name, each against its target, and the command.

The compute floor counts the FLOPs of one step from the shape (step_flops below) at
--peak-tflops (790: an H100 SXM's dense bf16 rate as the other benchmarks take it).

Usage: bench_qwen_image_table.py OUT/qwen_image --steps 6 --warmup 2 --pixels 1024x1024
       --text-tokens 256 --group-pixels 512x512 [--budget B --group-budget B --device D
       --dtype T --rank 16 --swap N --peak-tflops 790 --command "..."]
"""
import argparse
import json
import os
import re
import sys

# (this folder is on sys.path)
from bench_common import fmt, median_after, plan_summary, ratio, read_stats

GROUP_LINE = re.compile(
    r"Qwen-Image group: (\d+) of (\d+) blocks streamed(?: through (\d+) slots)?")
BANDWIDTH = re.compile(r"calibration on .*?H2D ([\d.]+) GB/s")
JOINED = re.compile(r"joins the Qwen-Image group \((\d+) jobs?\)")


def image_tokens(pixels):
    """Image tokens of a WIDTHxHEIGHT image: the VAE's 8x downscale, then 2x2 patches."""
    w, h = (int(v) for v in pixels.split("x"))
    return (w // 16) * (h // 16)


def step_flops(cfg, img, txt, rank, checkpointed=True):
    """FLOPs of one training step of one latent of `img` image tokens and `txt` text tokens,
    counted from the shape (a multiply-add is 2 FLOPs), for LoRA of `rank` on musubi-tuner's
    targets. Per block, with D = heads x head_dim and N = img + txt:
      - the frozen linears: each stream's q, k, v, out (4 D^2) and MLP (D -> 4D -> D: 8 D^2)
        over its own tokens: 2 x 12 D^2 x N forward;
      - attention over the joint sequence: Q K^T and P V, 2 N^2 D each: 4 N^2 D forward;
      - the LoRA: A and B of the 6 adapted linears per stream (their in + out widths add to
        4 x 2D + 2 x 5D = 18 D): 2 x r x 18 D x N forward;
      - backward: the frozen linears' input gradients (1x their forward), the LoRA's input and
        weight gradients (2x), attention's backward 2.5x its forward (5 of its matmuls against
        the forward's 2);
      - checkpointed: the forward again (the recompute) before the backward.
    The modulations (6 D x D per stream on the one timestep token), the norms, RoPE and the
    element-wise work are left out; outside the blocks, img_in, txt_in and proj_out forward
    and proj_out's input gradient are counted."""
    d = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    n = img + txt
    linear = 2 * 12 * d * d * n
    attention = 4 * n * n * d
    lora = 2 * rank * 18 * d * n
    forward = linear + attention + lora
    backward = linear + 2.5 * attention + 2 * lora
    block = forward * (2 if checkpointed else 1) + backward
    out = cfg.get("patch_size", 2) ** 2 * cfg.get("out_channels", 16)
    rest = 2 * d * (cfg["in_channels"] * img + cfg["joint_attention_dim"] * txt + 2 * out * img)
    return cfg["num_layers"] * block + rest


def plan_of(log):
    """What a run's log says of its plan: the streamed blocks, ring slots, the calibrated
    bandwidth and a budget's plan-summary (predicted_ms, floor_ms, resident_ms, peak_gib)."""
    out = plan_summary(log)
    if not os.path.exists(log):
        return out
    text = open(log, errors="replace").read()
    groups = GROUP_LINE.findall(text)
    if groups:  # the last: the group's plan once every job joined
        streamed, blocks, ring = groups[-1]
        out.update(streamed=int(streamed), blocks=int(blocks), ring=int(ring or 0))
    bw = BANDWIDTH.search(text)
    if bw:
        out["bandwidth_gbps"] = float(bw.group(1))
    joined = [int(j) for j in JOINED.findall(text)]
    if joined:  # the most jobs that trained together (a joiner beyond the budget waits)
        out["together"] = max(joined)
    return out


def plan_label(p):
    if "streamed" not in p:
        return "—"
    if p["streamed"] == 0:
        return f"{p['blocks']} resident"
    extra = "".join(f", {k} {int(v)}" for k, v in p.items()
                    if k not in ("streamed", "ring", "blocks", "bandwidth_gbps", "predicted_ms",
                                 "floor_ms", "resident_ms", "peak_gib", "together"))
    return f"{p['streamed']} of {p['blocks']} streamed, ring {p['ring']}{extra}"


def peer_row(label, plan, v, steps, img, floor, h2d_gb=None, pcie_floor_s=None):
    """A peer configuration's row of the table: its figures (`v`, its entry of the peer's
    "runs"; h2d_gb and pcie_floor_s where it streams), or its plan and its error."""
    if "step_seconds" not in v:
        return (f"| {label} | {plan}; failed: {v.get('error', '?')[:160]} | | | | | | | "
                f"{fmt(floor)} | | | |")
    streamed = f"{fmt(h2d_gb, 2)} | {fmt(pcie_floor_s)}" if h2d_gb is not None else "|"
    return (f"| {label} | {plan} | {v['steps']}/{steps} | {fmt(v['step_seconds'])} | "
            f"{img / v['step_seconds']:.0f} | | {streamed} | {fmt(floor)} | "
            f"{fmt(ratio(v['step_seconds'], floor), 2)} | {fmt(v.get('peak_gib'), 2)} | |")


def musubi_peer(out):
    """peer_musubi.json, or None and why it is missing (musubi_skipped.txt, else the last line
    of peer_musubi.log: the error that stopped it before its first configuration)."""
    path = os.path.join(out, "peer_musubi.json")
    if os.path.exists(path):
        return json.load(open(path)), None
    skipped = os.path.join(out, "musubi_skipped.txt")
    if os.path.exists(skipped):
        return None, open(skipped).read().strip()
    log = os.path.join(out, "peer_musubi.log")
    if os.path.exists(log):
        lines = [line.strip() for line in open(log, errors="replace") if line.strip()]
        return None, f"failed: {lines[-1][:300] if lines else 'no output'} (peer_musubi.log)"
    return None, "not in QI_BENCH_RUNS"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--pixels", default="1024x1024")
    ap.add_argument("--text-tokens", type=int, default=256)
    ap.add_argument("--group-pixels", default="512x512")
    ap.add_argument("--budget", default="24GiB")
    ap.add_argument("--group-budget", default="")
    ap.add_argument("--fp8-budget", default="12GiB")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--swap", default="?",
                    help="the musubi run's blocks_to_swap (QI_BENCH_SWAP; its labels only)")
    ap.add_argument("--peak-tflops", type=float, default=790)
    ap.add_argument("--command", default="tools/gpu/bench_qwen_image.sh OUT")
    args = ap.parse_args()
    out, w = args.out, args.warmup
    group_budget = args.group_budget or args.budget
    cfg_path = os.path.join(out, "config.json")
    if not os.path.exists(cfg_path):
        print(f"{cfg_path}: missing (the checkpoint's config.json, which the script copies)")
        return 1
    cfg = json.load(open(cfg_path))
    rate = args.peak_tflops * 1e12
    img, img_group, txt = (image_tokens(args.pixels), image_tokens(args.group_pixels),
                           args.text_tokens)

    runs = {}  # label -> figures
    group_jobs = sorted((f[len("stats_"):-len(".jsonl")] for f in os.listdir(out)
                         if re.fullmatch(r"stats_group\d+\.jsonl", f)),
                        key=lambda n: int(n[len("group"):]))
    for label, jobs, tokens in (("resident", ["resident"], img), ("streamed", ["streamed"], img),
                                ("fp8", ["fp8"], img), ("auto", ["auto"], img),
                                ("musubi", ["musubi"], img),
                                ("one", ["one"], img_group),
                                ("group", group_jobs, img_group)):
        stats = [s for s in (read_stats(os.path.join(out, f"stats_{j}.jsonl")) for j in jobs) if s]
        if not stats:
            continue
        plan = plan_of(os.path.join(out, f"train_{label}.log"))
        first = stats[0]
        step = median_after(first, "step_seconds", w)
        runs[label] = {
            "jobs": len(stats), "steps": min(len(s) for s in stats), "step_s": step,
            "tok_s": sum(median_after(s, "tokens", w) / median_after(s, "step_seconds", w)
                         for s in stats),
            "h2d_gb": median_after(first, "h2d_bytes", w) / 1e9,
            "peak_gib": max(r["peak_device_bytes"] for s in stats for r in s) / 2**30,
            "compute_floor_s": len(stats) * step_flops(cfg, tokens, txt, args.rank) / rate,
            "plan": plan}

    peer, peer_note = None, None
    if os.path.exists(os.path.join(out, "peer.json")):
        peer = json.load(open(os.path.join(out, "peer.json")))
    elif os.path.exists(os.path.join(out, "peer_skipped.txt")):
        peer_note = open(os.path.join(out, "peer_skipped.txt")).read().strip()
    musubi, musubi_note = musubi_peer(out)
    # The rate of the streamed-by-hand rows' PCIe floors: the musubi peer's pinned H2D copy of
    # one block, else our streamed run's calibration (GB/s).
    floor_bw, floor_bw_source = None, None
    if musubi and musubi.get("musubi", {}).get("h2d_bytes_per_second"):
        floor_bw = musubi["musubi"]["h2d_bytes_per_second"] / 1e9
        floor_bw_source = "the musubi peer's pinned H2D copy of one block"
    else:
        for label in ("streamed", "auto"):
            bw = runs.get(label, {}).get("plan", {}).get("bandwidth_gbps")
            if bw:
                floor_bw, floor_bw_source = bw, f"the {label} run's calibration"
                break

    layers = cfg["num_layers"]
    print(f"# Qwen-Image LoRA training: {layers} blocks, {args.pixels} ({img} image tokens), "
          f"{txt} text tokens")
    print()
    device = (peer or musubi or {}).get("device", args.device)
    print(f"`tools/gpu/bench_qwen_image.sh OUT` on {device}: "
          f"random weights of the checkpoint's shape (hidden "
          f"{cfg['num_attention_heads'] * cfg['attention_head_dim']}, text "
          f"{cfg['joint_attention_dim']} wide), batch 1, rank {args.rank} on musubi-tuner's "
          f"targets, {args.dtype}, {args.steps} steps per run, medians of steps {w + 1}-"
          f"{args.steps}. PCIe floor: the plan's bytes copied per step / the H2D bandwidth its "
          f"calibration measured. Compute floor: the step's FLOPs counted from the shape "
          f"(bench_qwen_image_table.py `step_flops`; checkpointed steps count the recompute) at "
          f"{args.peak_tflops:g} TFLOP/s.")
    print()
    print("| run | plan | steps | step s (median) | image tokens/s | predicted s | H2D GB / step | "
          "PCIe floor s | compute floor s | step / compute floor | peak GiB | estimated GiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    names = {"resident": "lorastream resident (blocks_to_swap = 0, checkpointed)",
             "streamed": f"lorastream within {args.budget}",
             "fp8": f"lorastream, fp8 store, within {args.fp8_budget}",
             "auto": "lorastream, gpu_memory_budget = \"auto\"",
             "musubi": f"lorastream, blocks_to_swap = {args.swap}, ring_size = 2 (beside "
                       f"musubi-tuner's)",
             "one": f"lorastream, one job at {args.group_pixels} within {group_budget}",
             "group": f"lorastream, a group of {runs.get('group', {}).get('jobs', 0)} at "
                      f"{args.group_pixels} within {group_budget}"}
    for label, r in runs.items():
        p = r["plan"]
        pred = p.get("predicted_ms")
        if label == "resident" and pred is None:  # the streamed plan's prediction of it
            pred = runs.get("streamed", {}).get("plan", {}).get("resident_ms")
        floor = p.get("floor_ms", 0.0 if p.get("streamed") == 0 else None)
        if floor is None and label == "musubi" and floor_bw:  # a plan by hand: no calibration
            floor = r["h2d_gb"] / floor_bw * 1e3
        r["pcie_floor_s"] = floor / 1e3 if floor is not None else None
        print(f"| {names[label]} | {plan_label(p)} | {r['steps']}/{args.steps} | "
              f"{fmt(r['step_s'])} | {r['tok_s']:.0f} | {fmt(pred / 1e3 if pred else None)} | "
              f"{fmt(r['h2d_gb'], 2)} | {fmt(r['pcie_floor_s'])} | {fmt(r['compute_floor_s'])} | "
              f"{fmt(ratio(r['step_s'], r['compute_floor_s']), 2)} | {fmt(r['peak_gib'], 2)} | "
              f"{fmt(p.get('peak_gib'), 2)} |")
    best = best_ckpt = None
    if peer:
        for name, v in peer.get("runs", {}).items():
            ckpt = v["config"].get("checkpointing", True)
            floor = step_flops(cfg, img, txt, args.rank, ckpt) / rate
            print(peer_row(f"diffusers + peft: {name}", "resident", v, args.steps, img, floor))
            if "step_seconds" in v:
                if best is None or v["step_seconds"] < best[1]["step_seconds"]:
                    best = (name, v)
                if ckpt and (best_ckpt is None or v["step_seconds"] < best_ckpt[1]["step_seconds"]):
                    best_ckpt = (name, v)
    best_musubi = None
    if musubi:
        m = musubi.get("musubi", {})
        plan = (f"{m.get('streamed')} of {m.get('blocks')} streamed, ring {m.get('ring')}"
                f"{', pinned' if m.get('pinned') else ''}")
        floor = step_flops(cfg, img, txt, args.rank) / rate
        for name, v in musubi.get("runs", {}).items():
            v["h2d_gb"] = median_after(v.get("h2d_bytes", []), None, w) / 1e9
            v["pcie_floor_s"] = v["h2d_gb"] / floor_bw if floor_bw else None
            print(peer_row(f"diffusers + peft, {name}", plan, v, args.steps, img, floor,
                           v["h2d_gb"], v["pcie_floor_s"]))
            if "step_seconds" not in v:
                continue
            if best_musubi is None or v["step_seconds"] < best_musubi[1]["step_seconds"]:
                best_musubi = (name, v)
    print()
    if peer:
        print(f"Peer: torch {peer['torch']}, diffusers {peer['diffusers']}, peft {peer['peft']}; "
              f"{peer.get('lora_modules')} LoRA modules, {peer.get('lora_parameters')} LoRA "
              f"parameters; load {fmt(peer.get('load_seconds'), 1)} s; each configuration within "
              f"its deadline, a failure (out of memory, a backend missing) is its row's error.")
        if "wall_seconds" not in peer:
            print("The peer was stopped (QI_BENCH_PEER_TIMEOUT) before every configuration ran.")
    else:
        print(f"Peer (diffusers + peft): not run here ({peer_note or 'not in QI_BENCH_RUNS'}).")
    for label in ("streamed", "auto", "one", "group"):
        bw = runs.get(label, {}).get("plan", {}).get("bandwidth_gbps")
        if bw:
            print(f"The {label} run's calibration measured H2D at {bw:g} GB/s.")
    mu = runs.get("musubi")
    if musubi:
        m = musubi.get("musubi", {})
        print(f"musubi-tuner's streaming: its {m.get('class')} ({m.get('offloader')}) driving "
              f"diffusers' model + peft (torch {musubi.get('torch')}, diffusers "
              f"{musubi.get('diffusers')}, peft {musubi.get('peft')}) around diffusers' block "
              f"loop as its own Qwen-Image model drives it: {m.get('streamed')} of "
              f"{m.get('blocks')} blocks streamed (blocks {m.get('stream_idx')}: its placement, at "
              f"even intervals) through {m.get('ring')} slots from "
              f"{'pinned' if m.get('pinned') else 'pageable'} host masters, "
              f"{fmt((m.get('block_bytes') or float('nan')) / 2**20, 0)} MiB a block; between "
              f"steps {m.get('streamed_on_host_between_steps', '?')} of the streamed blocks' "
              f"weights were on the host (the ring holds the others); checkpointed, each SDPA "
              f"kernel (each row); load {fmt(musubi.get('load_seconds'), 1)} s.")
        if "wall_seconds" not in musubi:
            print("The musubi peer was stopped (QI_BENCH_PEER_TIMEOUT) before every configuration "
                  "ran.")
    elif mu or musubi_note != "not in QI_BENCH_RUNS":
        print(f"musubi-tuner's streaming: not run here ({musubi_note}).")
    if floor_bw and (mu or musubi):
        print(f"The streamed-by-hand rows' PCIe floors: their bytes copied per step / "
              f"{floor_bw:.1f} GB/s ({floor_bw_source}).")
    if mu or musubi:
        theirs = best_musubi[1] if best_musubi else {}
        print()
        print(f"| against musubi-tuner | ours: step s | H2D GB / step | PCIe floor s | peak GiB | "
              f"musubi-tuner LoRAStreamOffloader"
              f"{' (' + best_musubi[0].split(', checkpointed, ')[-1] + ')' if best_musubi else ''}"
              f": step s | H2D GB / step | "
              f"PCIe floor s | peak GiB | ours / musubi-tuner | target |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        streamed = (mu or {}).get("plan", {}).get("streamed", args.swap)
        print(f"| ours streamed {streamed}/{layers}, ring 2 beside musubi-tuner's "
              f"{(musubi or {}).get('musubi', {}).get('streamed', args.swap)}/{layers}, ring 2 "
              f"| {fmt((mu or {}).get('step_s'))} | {fmt((mu or {}).get('h2d_gb'), 2)} | "
              f"{fmt((mu or {}).get('pcie_floor_s'))} | {fmt((mu or {}).get('peak_gib'), 2)} | "
              f"{fmt(theirs.get('step_seconds'))} | {fmt(theirs.get('h2d_gb'), 2)} | "
              f"{fmt(theirs.get('pcie_floor_s'))} | {fmt(theirs.get('peak_gib'), 2)} | "
              f"{fmt(ratio((mu or {}).get('step_s'), theirs.get('step_seconds')))} | <= 0.8 |")
    print()
    print("| ratio | value | target |")
    print("| --- | --- | --- |")
    res, st, one, gr = (runs.get(k) for k in ("resident", "streamed", "one", "group"))
    if res and best_ckpt:
        print(f"| resident / diffusers + peft checkpointed at its fastest, like with like "
              f"({best_ckpt[0]}) | {fmt(ratio(res['step_s'], best_ckpt[1]['step_seconds']))} | "
              f"<= 0.8 |")
    if res and best:
        print(f"| resident / diffusers + peft at its fastest ({best[0]}) | "
              f"{fmt(ratio(res['step_s'], best[1]['step_seconds']))} | |")
    if runs.get("auto") and best:
        print(f"| \"auto\" / diffusers + peft at its fastest | "
              f"{fmt(ratio(runs['auto']['step_s'], best[1]['step_seconds']))} | |")
    if res and not best:
        print("| resident / diffusers + peft | — (no peer figures) | <= 0.8 like with like |")
    if st:
        print(f"| streamed within {args.budget} / its PCIe floor | "
              f"{fmt(ratio(st['step_s'], st['pcie_floor_s']))} | |")
        if res:
            print(f"| streamed within {args.budget} / resident | "
                  f"{fmt(ratio(st['step_s'], res['step_s']))} | <= 1.05 (the target's, within "
                  f"16 GiB at 1024x1024) |")
            floor = max(st["pcie_floor_s"] or 0.0, res["step_s"])
            print(f"| streamed / max(its PCIe floor, the resident step) | "
                  f"{fmt(ratio(st['step_s'], floor))} | |")
    f8 = runs.get("fp8")
    if f8:
        print(f"| fp8 store within {args.fp8_budget} / its PCIe floor | "
              f"{fmt(ratio(f8['step_s'], f8['pcie_floor_s']))} | |")
        if res:
            print(f"| fp8 store within {args.fp8_budget} / resident | "
                  f"{fmt(ratio(f8['step_s'], res['step_s']))} | |")
        print(f"| fp8 store within {args.fp8_budget}: peak GiB | {fmt(f8['peak_gib'], 2)} | "
              f"<= {args.fp8_budget} |")
    if mu or musubi:
        why = ("" if mu and best_musubi else
               " (no figures of ours)" if best_musubi else
               " (musubi-tuner's: not run, above)" if musubi_note else
               " (musubi-tuner's: no configuration ran)")
        value = fmt(ratio(mu["step_s"], best_musubi[1]["step_seconds"])) if mu and best_musubi \
            else "—"
        print(f"| ours streamed {args.swap}/{layers}, ring 2 / musubi-tuner's LoRAStreamOffloader "
              f"with the same blocks_to_swap, ring 2, at its fastest{why} | {value} | <= 0.8 |")
    if mu:
        print(f"| ours streamed {args.swap}/{layers}, ring 2: peak GiB | {fmt(mu['peak_gib'], 2)} "
              f"| <= 16 (the target's, at 60 blocks and 1024x1024) |")
    if gr and gr["plan"].get("together", gr["jobs"]) < gr["jobs"]:
        print(f"| group: jobs that trained together | {gr['plan']['together']} of {gr['jobs']} "
              f"(the others waited: the budget admitted no more) | {gr['jobs']} |")
    if gr and one:
        k = gr["jobs"]
        print(f"| group of {k} at {args.group_pixels}: image tokens/s over one job's | "
              f"{fmt(ratio(gr['tok_s'], one['tok_s']), 2)} | >= 2 (the target's, 4 jobs at "
              f"512x512) |")
        # The group's floor: its copies or its compute, whichever is longer.
        if gr.get("pcie_floor_s") is not None and gr.get("compute_floor_s"):
            floor = max(gr["pcie_floor_s"], gr["compute_floor_s"])
            print(f"| group of {k}: step / its floor, max(PCIe {fmt(gr['pcie_floor_s'])} s, "
                  f"compute {fmt(gr['compute_floor_s'])} s) | {fmt(ratio(gr['step_s'], floor), 3)} "
                  f"| <= 1.05 |")
        print(f"| group of {k}: H2D bytes per step / one job's | "
              f"{fmt(ratio(gr['h2d_gb'], one['h2d_gb']), 3)} | |")
    print()
    print(f"Command: `{args.command}`")
    complete = all(r["steps"] == args.steps for r in runs.values())
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())
