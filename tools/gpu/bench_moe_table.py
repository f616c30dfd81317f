#!/usr/bin/env python3
"""The table of tools/gpu/bench_moe.sh: reads OUT/moe/stats_NAME.jsonl (each job's per-step
statistics), train_LABEL.log (the plan the worker chose: its line "stream plan from ...", with
the H2D bandwidth its calibration measured, its prediction and memory estimate) and peer.json
(transformers + peft), and for the nf4 run store_nf4.json and store_nf4_ls.txt (the store's
bytes, PSS and segments), and prints markdown: per run the median step after the warm-up steps,
tokens/s, the bytes copied per step and their PCIe floor (bytes / the calibrated bandwidth),
the stall, the peak device memory beside the plan's estimate; the peer's configurations; then
the ratios the mixture-of-experts targets name, each against its target; the NF4 store's RAM
against 18 GB (extrapolated to --full-layers blocks where the run had fewer) and its job's peak
against --nf4-budget.

Usage: bench_moe_table.py OUT/moe --steps 8 --warmup 3 [--preset P --layers N --tokens T
       --budget B --device D --dtype T --nf4-budget B --full-layers N]
"""
import argparse
import json
import os
import re
import sys

from bench_common import fmt, median_after, ratio, read_stats  # this folder is on sys.path

PLAN = re.compile(r"stream plan from (.*?)(?: by the cost model \((\d+) candidates; (.*?)\))?: (.*?)"
                  r"(?:; predicted ([\d.]+) ms per step \(resident ([\d.]+) ms\))?; estimate ([\d.]+) GiB at the peak")
BANDWIDTH = re.compile(r"H2D ([\d.]+) GB/s")
NOT_PLANNED = re.compile(r"the group of (\d+) jobs cannot be planned")
JOINED = re.compile(r"joins the group \((\d+) jobs?\)")
SIZE = re.compile(r"\s*([\d.]+)\s*(B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)?\s*")
UNITS = {None: 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
         "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}
NF4_TARGET_GB = 18


def size_bytes(text):
    """A budget such as "16GiB" in bytes; None for anything else ("auto")."""
    m = SIZE.fullmatch(text or "")
    return float(m.group(1)) * UNITS[m.group(2)] if m else None


def last_error(log):
    """The last line of a log that says error (else its last line): why a run failed."""
    if not os.path.exists(log):
        return "no log"
    lines = [x.strip() for x in open(log, errors="replace") if x.strip()]
    errors = [x for x in lines if re.search(r"\berror\b|what\(\)|terminate", x, re.I)]
    return ((errors or lines or ["empty log"])[-1])[:240]


def nf4_store(out, full_layers):
    """The nf4 run's store: store_nf4.json's figures (numbers where they are), its segments'
    bytes (store_nf4_ls.txt) and, where every block's segment has the same bytes and the run
    had fewer than full_layers, the store extrapolated to full_layers blocks. None: no nf4 run."""
    path = os.path.join(out, "store_nf4.json")
    if not os.path.exists(path):
        return None
    store = json.load(open(path))
    for key, value in list(store.items()):
        try:
            store[key] = float(value)
        except (TypeError, ValueError):
            pass
    ls = os.path.join(out, "store_nf4_ls.txt")
    blocks, rest = [], None
    if os.path.exists(ls):
        for line in open(ls):
            f = line.split()
            if len(f) == 2 and f[0].isdigit():
                if re.search(r"\.block\.\d+$", f[1]):
                    blocks.append(int(f[0]))
                elif f[1].endswith(".rest"):
                    rest = int(f[0])
    store["blocks"] = len(blocks)
    if blocks and rest is not None and 0 < len(blocks) < full_layers:
        if len(set(blocks)) == 1:
            store["extrapolated_bytes"] = rest + full_layers * blocks[0]
            store["block_segment_bytes"], store["rest_bytes"] = blocks[0], rest
        else:
            store["not_extrapolated"] = "its block segments differ in bytes"
    return store


def plan_of(log):
    """The first plan line of a run's log: what it chose, predicted and estimated."""
    out = {}
    if not os.path.exists(log):
        return out
    text = open(log, errors="replace").read()
    m = PLAN.search(text)
    if m:
        desc = re.sub(r"resident \[([\d ]*)\]",
                      lambda r: f"{len(r.group(1).split())} resident", m.group(4))
        desc = re.sub(r"\s*\[[\d ]*\]", "", desc)  # the streamed blocks' list
        out = {"from": m.group(1), "plan": desc, "costs": m.group(3),
               "predicted_ms": float(m.group(5)) if m.group(5) else None,
               "resident_predicted_ms": float(m.group(6)) if m.group(6) else None,
               "estimate_gib": float(m.group(7))}
        bw = BANDWIDTH.search(m.group(3) or "")
        out["bandwidth_gbps"] = float(bw.group(1)) if bw else None
    unplanned = NOT_PLANNED.findall(text)
    if unplanned:
        out["unplanned_groups"] = unplanned
    joined = [int(n) for n in JOINED.findall(text)]
    if joined:  # the most jobs that trained together (a joiner beyond the budget waits)
        out["together"] = max(joined)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--layers", default="16")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--budget", default="24GiB")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--nf4-budget", default="16GiB")
    ap.add_argument("--hand", default="", help="the hand run's [stream] keys")
    ap.add_argument("--optim", default="adamw", help="the jobs' optim.type")
    ap.add_argument("--full-layers", type=int, default=0,
                    help="the preset's depth: the nf4 store is extrapolated to it (0: not)")
    args = ap.parse_args()
    out, w = args.out, args.warmup

    runs = {}  # label -> figures
    for label, jobs in (("resident", ["resident"]), ("auto", ["auto"]), ("streamed", ["streamed"]),
                        ("hand", ["hand"]), ("nf4", ["nf4"]),
                        ("group", sorted((f[len("stats_"):-len(".jsonl")] for f in os.listdir(out)
                                          if re.fullmatch(r"stats_group\d+\.jsonl", f)),
                                         key=lambda n: int(n[len("group"):])))):
        stats = [read_stats(os.path.join(out, f"stats_{j}.jsonl")) for j in jobs]
        stats = [s for s in stats if s]
        if not stats:
            continue
        plan = plan_of(os.path.join(out, f"train_{label}.log"))
        first = stats[0]
        step = median_after(first, "step_seconds", w)
        h2d = median_after(first, "h2d_bytes", w)
        bw = plan.get("bandwidth_gbps")
        busy = median_after(first, "h2d_busy_seconds", w)
        runs[label] = {
            "jobs": len(stats), "steps": min(len(s) for s in stats), "step_s": step,
            "tok_s": sum(args.tokens / median_after(s, "step_seconds", w) for s in stats),
            "h2d_gb": h2d / 1e9, "busy_gbps": h2d / busy / 1e9 if busy > 0 else None,
            "stall_ms": median_after(first, "stall_seconds", w) * 1e3,
            "peak_gib": max(r["peak_device_bytes"] for s in stats for r in s) / 2**30,
            "pcie_floor_s": h2d / (bw * 1e9) if bw else None,
            "loss_last": first[-1]["loss"], **plan}
    # A plan by hand calibrates nothing: its floor at the bandwidth the streamed run measured.
    hand, streamed = runs.get("hand"), runs.get("streamed")
    if hand and hand["pcie_floor_s"] is None and streamed and streamed.get("bandwidth_gbps"):
        hand["pcie_floor_s"] = hand["h2d_gb"] / streamed["bandwidth_gbps"]
    nf4 = nf4_store(out, args.full_layers)
    peer = None
    if os.path.exists(os.path.join(out, "peer.json")):
        peer = json.load(open(os.path.join(out, "peer.json")))

    print(f"# Mixture of experts: {args.preset}, {args.layers} layers, {args.tokens} tokens")
    print()
    print(f"`tools/gpu/bench_moe.sh OUT` on {peer['device'] if peer else args.device}: batch 1, "
          f"rank 16 on q/k/v/o_proj and every expert's gate/up/down, optim.type = \"{args.optim}\", "
          f"{args.dtype}, {args.steps} steps "
          f"per run, medians of steps {w + 1}-{args.steps}; streamed runs within "
          f"gpu_memory_budget = \"{args.budget}\"; PCIe floor = H2D bytes per step / the "
          f"bandwidth the run's calibration measured.")
    print()
    print("| run | plan | steps | step s (median) | tokens/s | predicted s | H2D GB / step | "
          "PCIe floor s | stall ms | peak GiB | estimated GiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    names = {"resident": "lorastream resident (blocks_to_swap = 0, checkpointed)",
             "auto": "lorastream, gpu_memory_budget = \"auto\" (the planner's choice)",
             "streamed": f"lorastream within {args.budget}",
             "hand": f"lorastream, a plan by hand ({args.hand})",
             "nf4": f"lorastream on an NF4 store within {args.nf4_budget}",
             "group": f"lorastream, a group of {runs.get('group', {}).get('jobs', 0)} within {args.budget}"}
    # A group whose jobs never all trained together (the budget held fewer: they joined as
    # memory allowed, one group after another) has no group step: its figures would be one
    # job's or a smaller group's, so none are printed.
    gr = runs.get("group")
    apart = gr is not None and gr.get("together", gr["jobs"]) < gr["jobs"]
    for label, r in runs.items():
        if label == "group" and apart:
            print(f"| {names[label]} | did not train as one group: at most {r['together']} of "
                  f"{r['jobs']} jobs together (train_group.log) | {r['steps']}/{args.steps} | "
                  f"| | | | | | | |")
            continue
        pred = r.get("predicted_ms")
        print(f"| {names[label]} | {r.get('plan', '—')} | {r['steps']}/{args.steps} | "
              f"{fmt(r['step_s'])} | {r['tok_s']:.0f} | {fmt(pred / 1e3 if pred else None)} | "
              f"{fmt(r['h2d_gb'], 2)} | {fmt(r['pcie_floor_s'])} | {fmt(r['stall_ms'], 1)} | "
              f"{fmt(r['peak_gib'], 2)} | {fmt(r.get('estimate_gib'), 2)} |")
    if nf4 is not None and "nf4" not in runs:
        why = (nf4.get("error")
               or f"the job failed: {last_error(os.path.join(out, 'train_nf4.log'))}")
        print(f"| {names['nf4']} | failed: {why.replace('|', '/')} | | | | | | | | | |")
    best_peer = best_ckpt = None
    if peer:
        for name, v in peer.get("runs", {}).items():
            if "step_seconds" in v:
                print(f"| transformers + peft: {name} | resident | {v['steps']}/{args.steps} | "
                      f"{fmt(v['step_seconds'])} | {v['tokens_per_second']:.0f} | | | | | "
                      f"{fmt(v['peak_gib'], 2)} | |")
                if best_peer is None or v["step_seconds"] < best_peer[1]["step_seconds"]:
                    best_peer = (name, v)
                if v["config"].get("checkpointing") and (
                        best_ckpt is None or v["step_seconds"] < best_ckpt[1]["step_seconds"]):
                    best_ckpt = (name, v)
            else:
                print(f"| transformers + peft: {name} | failed: {v.get('error', '?')[:160]} | "
                      f"| | | | | | | | |")
    print()
    if runs.get("streamed", {}).get("bandwidth_gbps"):
        print(f"H2D bandwidth measured by the streamed run's calibration: "
              f"{runs['streamed']['bandwidth_gbps']} GB/s; its copies ran at "
              f"{fmt(runs['streamed']['busy_gbps'], 1)} GB/s while busy.")
    for label in ("streamed", "group"):
        if runs.get(label, {}).get("costs"):
            print(f"{label} run's calibrated costs: {runs[label]['costs']}.")
    if apart:
        print(f"The group's {gr['jobs']} jobs never trained together within {args.budget}: no "
              f"group figures.")
    if runs.get("group", {}).get("unplanned_groups"):
        print(f"The group run's log says groups of {', '.join(runs['group']['unplanned_groups'])} "
              f"jobs could not be planned within the budget (jobs joined as memory allowed).")
    if nf4 is not None and "store_bytes" in nf4:
        ckpt = nf4["checkpoint_bytes"]
        serve = f"lorastream-store serve --quantize nf4 {nf4.get('args', '')}".strip()
        print(f"NF4 store (`{serve}`, {nf4['blocks']} blocks): {nf4['store_bytes'] / 1e9:.3f} GB "
              f"({fmt(ratio(nf4['store_bytes'], ckpt))}x the {args.dtype} checkpoint's "
              f"{ckpt / 1e9:.3f} GB; blocks {nf4['block_bytes'] / 1e9:.3f} GB), PSS of its "
              f"segments {nf4['pss_bytes'] / 1e9:.3f} GB over {nf4['processes']:.0f} process(es) "
              f"({fmt(ratio(nf4['pss_bytes'], nf4['store_bytes']))}x its bytes); serve "
              f"{fmt(nf4.get('serve_wall_s'), 1)} s, "
              f"{nf4.get('quantised') or 'no quantising line in its log'}.")
        if "extrapolated_bytes" in nf4:
            print(f"Extrapolated to {args.full_layers} blocks (not measured: the rest segment "
                  f"{nf4['rest_bytes'] / 1e9:.3f} GB + {args.full_layers} x one block's "
                  f"{nf4['block_segment_bytes'] / 1e9:.3f} GB): "
                  f"{nf4['extrapolated_bytes'] / 1e9:.2f} GB "
                  f"({nf4['extrapolated_bytes']:.0f} bytes).")
        elif nf4.get("not_extrapolated"):
            print(f"Not extrapolated to {args.full_layers} blocks: {nf4['not_extrapolated']}.")
    if peer:
        print(f"Peer: torch {peer['torch']}, transformers {peer['transformers']}, peft "
              f"{peer['peft']}; {peer.get('lora_parameters')} LoRA parameters; peft config "
              f"{json.dumps(peer.get('peft_config'))}; load {fmt(peer.get('load_seconds'), 1)} s.")
    print()
    print("| ratio | value | target |")
    print("| --- | --- | --- |")
    res, st = runs.get("resident"), runs.get("streamed")
    gr = None if apart else gr
    if res and best_peer:
        print(f"| resident / transformers + peft at its best ({best_peer[0]}) | "
              f"{fmt(ratio(res['step_s'], best_peer[1]['step_seconds']))} | <= 0.6 |")
    if res and best_ckpt:
        print(f"| resident / transformers + peft checkpointed, like with like ({best_ckpt[0]}) | "
              f"{fmt(ratio(res['step_s'], best_ckpt[1]['step_seconds']))} | |")
    if runs.get("auto") and best_peer:
        print(f"| planner's choice (\"auto\") / transformers + peft at its best | "
              f"{fmt(ratio(runs['auto']['step_s'], best_peer[1]['step_seconds']))} | |")
    if st:
        print(f"| streamed within {args.budget} / its PCIe floor | "
              f"{fmt(ratio(st['step_s'], st['pcie_floor_s']))} | <= 1.1 |")
        if res:
            floor = max(x for x in (st["pcie_floor_s"] or 0, res["step_s"]))
            print(f"| streamed / max(PCIe floor, resident step) | "
                  f"{fmt(ratio(st['step_s'], floor))} | |")
            print(f"| streamed / resident | {fmt(ratio(st['step_s'], res['step_s']))} | |")
    if hand:
        print(f"| a plan by hand ({args.hand}) / its PCIe floor | "
              f"{fmt(ratio(hand['step_s'], hand['pcie_floor_s']))} | |")
        if st:
            print(f"| the planner's plan within {args.budget} / the plan by hand | "
                  f"{fmt(ratio(st['step_s'], hand['step_s']))} | |")
    if gr:
        print(f"| group of {gr['jobs']} within {args.budget} / its PCIe floor | "
              f"{fmt(ratio(gr['step_s'], gr['pcie_floor_s']))} | |")
    if gr and st:
        print(f"| group of {gr['jobs']}: tokens/s / one streamed job's | "
              f"{fmt(ratio(gr['tok_s'], st['tok_s']), 2)} | >= 3 (4 jobs) |")
        print(f"| group of {gr['jobs']}: tokens/s / ({gr['jobs']} x one streamed job's) | "
              f"{fmt(ratio(gr['tok_s'], gr['jobs'] * st['tok_s']), 3)} | |")
        print(f"| group of {gr['jobs']}: H2D bytes per step / one streamed job's | "
              f"{fmt(ratio(gr['h2d_gb'], st['h2d_gb']), 3)} | |")
    if nf4 is not None:
        if "store_bytes" in nf4:
            full = nf4.get("extrapolated_bytes")
            ram = (f"NF4 store RAM {nf4['pss_bytes'] / 1e9:.2f} GB (PSS, {args.layers} layers"
                   + (f"; {full / 1e9:.2f} GB extrapolated to {args.full_layers}" if full else "")
                   + f") (target ≤ {NF4_TARGET_GB} GB: "
                   + ("yes" if (full or nf4["pss_bytes"]) <= NF4_TARGET_GB * 1e9 else "no") + ")")
        else:
            ram = f"NF4 store RAM — ({nf4.get('error', 'no figures')})"
        n, budget = runs.get("nf4"), size_bytes(args.nf4_budget)
        if n is None:
            peak = "peak — (the job did not train)"
        elif n["peak_gib"] == 0:
            peak = f"peak — ({args.device} reports no device memory)"
        else:
            within = ("yes" if n["peak_gib"] * 2**30 <= budget else "no") if budget else "—"
            peak = f"peak {n['peak_gib']:.2f} GiB within {args.nf4_budget}: {within}"
        print(f"| NF4 store's RAM; its job's peak device memory | {ram}; {peak} | "
              f"≤ {NF4_TARGET_GB} GB; within 16 GiB |")
    ok = all(r["steps"] == args.steps for r in runs.values()) and bool(runs) and not apart
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
