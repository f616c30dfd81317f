#!/usr/bin/env python3
"""The table of tools/gpu/bench_flux.sh: reads OUT/flux/stats_{resident,streamed}.jsonl (each
job's per-step statistics: step_seconds, h2d_bytes, peak_device_bytes), train_streamed.log or
plan_streamed.txt (the streamed plan and the resident step's prediction), the same of a
compressed store's runs when they ran (stats_resident_fp8.jsonl, plan_streamed_fp8.txt; nf4
alike), stats_groupK.jsonl and train_group.log (a job group of K streamed jobs, when it ran)
and peer.json when the peer ran, and prints markdown: per run the measured step (median of the steps after the first
two), the planner's prediction, the peak memory measured and estimated, the bytes copied per
step; then the ratios the FLUX targets name, a compressed store's steps against the plain
store's, and the group's step against K x one job's.

Usage: bench_flux_table.py OUT/flux STEPS
"""
import json
import os
import re
import sys

from bench_common import fmt, median_after, plan_summary, ratio, read_stats  # this folder is on sys.path

def steps(out, name):
    """The job's step rows from its stats.jsonl (OUT/stats_NAME.jsonl, which the script copies
    from the job's output folder)."""
    return [{"step": r["step"], "loss": r["loss"], "seconds": r["step_seconds"],
             "h2d": r["h2d_bytes"], "peak_gib": r["peak_device_bytes"] / 2**30}
            for r in read_stats(os.path.join(out, f"stats_{name}.jsonl"))]


def median_after_warmup(rows, key):
    return median_after(rows, key, 2)


def main():
    out, total = sys.argv[1], int(sys.argv[2])
    runs = {}
    names = ["resident", "streamed"]
    for fmt_name in ("fp8", "nf4"):
        if os.path.exists(os.path.join(out, f"stats_resident_{fmt_name}.jsonl")):
            names += [f"resident_{fmt_name}", f"streamed_{fmt_name}"]
    for name in names:
        suffix = name[len("resident"):] if name.startswith("resident") else name[len("streamed"):]
        # The streamed run's own plan (its log holds the table it chose from), else the plan
        # command's; the resident step's prediction from the same figures.
        planned = (plan_summary(os.path.join(out, f"train_streamed{suffix}.log"))
                   or plan_summary(os.path.join(out, f"plan_streamed{suffix}.txt")))
        rows = steps(out, name)
        plan = planned if name.startswith("streamed") else {
            "predicted_ms": planned.get("resident_ms", float("nan")), "streamed": 0, "ring": 0}
        runs[name] = {
            "steps": len(rows),
            "seconds": median_after_warmup(rows, "seconds"),
            "peak": max((r["peak_gib"] for r in rows), default=float("nan")),
            "h2d": median_after_warmup(rows, "h2d") / 1e9 if rows else float("nan"),
            "predicted": plan.get("predicted_ms", float("nan")) / 1e3,
            "estimate": plan.get("peak_gib", float("nan")),
            "floor": plan.get("floor_ms", float("nan")) / 1e3,
            "streamed": plan.get("streamed"),
            "ring": plan.get("ring"),
        }
    peer = None
    peer_path = os.path.join(out, "peer.json")
    if os.path.exists(peer_path):
        peer = json.load(open(peer_path))

    r, s = runs["resident"], runs["streamed"]
    print("| run | plan | steps | step s (median) | predicted s | predicted / measured | "
          "peak GiB | estimated GiB | H2D GB / step |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, x in runs.items():
        plan = "resident" if not x["streamed"] else f"{int(x['streamed'])} units streamed, ring {int(x['ring'])}"
        print(f"| {name} | {plan} | {x['steps']}/{total} | {fmt(x['seconds'])} | "
              f"{fmt(x['predicted'])} | {fmt(ratio(x['predicted'], x['seconds']), 2)} | "
              f"{fmt(x['peak'], 2)} | {fmt(x['estimate'], 2)} | {fmt(x['h2d'], 2)} |")
    print(f"| PCIe floor of the streamed plan | bytes / bandwidth | | {fmt(s['floor'])} | | | | | |")
    if peer:
        for k, v in sorted(peer.get("runs", {}).items()):
            print(f"| diffusers + peft, {k} | resident | {v.get('steps', '')} | "
                  f"{fmt(v.get('step_seconds'))} | | | {fmt(v.get('peak_gib'), 2)} | | |")
    print()
    print("| ratio | value | target |")
    print("| --- | --- | --- |")
    print(f"| streamed / resident | {fmt(ratio(s['seconds'], r['seconds']), 3)} | <= 1.15 (or the floor's) |")
    print(f"| streamed / PCIe floor | {fmt(ratio(s['seconds'], s['floor']), 3)} | <= 1.05 (or the resident's) |")
    print(f"| streamed peak / budget plan's estimate | {fmt(ratio(s['peak'], s['estimate']), 3)} | <= 1 |")
    for name in names:
        print(f"| {name}: predicted / measured | {fmt(ratio(runs[name]['predicted'], runs[name]['seconds']), 3)} | within 0.9 .. 1.1 |")
    for name in names[2:]:
        plain = runs[name.split("_")[0]]
        print(f"| {name} / {name.split('_')[0]} (step) | {fmt(ratio(runs[name]['seconds'], plain['seconds']), 3)} | |")
        print(f"| {name} / {name.split('_')[0]} (H2D per step) | {fmt(ratio(runs[name]['h2d'], plain['h2d']), 3)} | |")
    if peer:
        best = min((v["step_seconds"] for v in peer.get("runs", {}).values()
                    if v.get("step_seconds")), default=None)
        ckpt = peer.get("runs", {}).get("checkpointed", {}).get("step_seconds")
        print(f"| resident / diffusers+peft checkpointed (like with like) | {fmt(ratio(r['seconds'], ckpt), 3)} | <= 0.8 |")
        print(f"| resident / diffusers+peft best | {fmt(ratio(r['seconds'], best), 3)} | |")
    ok = all(x["steps"] == total for x in runs.values())

    group = {f[len("stats_"):-len(".jsonl")]: None for f in os.listdir(out)
             if re.fullmatch(r"stats_group\d+\.jsonl", f)}
    group = {name: steps(out, name) for name in sorted(group, key=lambda n: int(n[5:]))}
    if group:
        k = len(group)
        first = group[sorted(group)[0]]
        log_path = os.path.join(out, "train_group.log")
        plan = plan_summary(log_path)
        log = open(log_path).read() if os.path.exists(log_path) else ""
        if not re.search(rf"joins the \S+ group \({k} jobs\)", log):
            # Planned for the first job alone (the others joined as it left): one after
            # another, the steps are no group's.
            print()
            print(f"The {k} group jobs did not train as one group (no step had all {k}; "
                  f"train_group.log says why): no group figures.")
            return 1
        g_seconds = median_after_warmup(first, "seconds")
        g_h2d = median_after_warmup(first, "h2d") / 1e9
        print()
        print(f"| group of {k} jobs | plan | steps | group step s (median) | predicted s | "
              f"group step / ({k} x one job's streamed step) | peak GiB | estimated GiB | "
              f"H2D GB / step | H2D / one job's |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        streamed_plan = (f"{int(plan['streamed'])} units streamed, ring {int(plan['ring'])}"
                         if plan.get("streamed") else "resident")
        print(f"| {k} x the streamed job | {streamed_plan} | "
              f"{min(len(r) for r in group.values())}/{total} | {fmt(g_seconds)} | "
              f"{fmt(plan.get('predicted_ms', float('nan')) / 1e3)} | "
              f"{fmt(ratio(g_seconds, k * s['seconds']), 3)} | "
              f"{fmt(max((r['peak_gib'] for r in first), default=float('nan')), 2)} | "
              f"{fmt(plan.get('peak_gib', float('nan')), 2)} | {fmt(g_h2d, 2)} | "
              f"{fmt(ratio(g_h2d, s['h2d']), 3)} |")
        ok = ok and all(len(r) == total for r in group.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
