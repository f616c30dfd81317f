#!/usr/bin/env python3
"""Job groups on one GPU: K jobs in one `lorastream-worker train A.toml B.toml ...` against what
a user can do without groups, side by side in one run.

On a CUDA machine, against a store serving a 16-layer llama-3-8b-shaped checkpoint (bf16, the
one tools/gpu/bench_stream.sh synthesises; its store is started by bench_group.sh), batch 1,
rank 16 on all seven projections, for each length (512 and 2048 tokens) and plan (12 of 16
blocks streamed through a ring of 2; everything resident):

  group K   lorastream-worker train J1.toml ... JK.toml       K = 1, 2, 4 (and 8: bytes only)
  serial 4  four jobs one after another (lorastream-worker train Ji.toml, i = 1..4)
  procs 4   four processes side by side on the same GPU (--device cuda:0 four times)

Figures (medians over the steps after the warm-up): the group step, its aggregate tokens/s and
its ratio to one job alone with the same plan, the bytes copied per step, the stall, the peak
device memory beside the plan's estimate for the group, and the floor: max(bytes / the
bandwidth the run measured, the resident group's step). Writes OUT/bench_group.md (the table and the command) and OUT/bench_group.json; each run's
stats and log under OUT/group/.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

from bench_multi_gpu import JOB, log, write_data  # this folder is on sys.path


class Bench:
    def __init__(self, args):
        self.args = args
        self.root = os.path.join(args.out, "group")
        os.makedirs(self.root, exist_ok=True)
        self.runs = 0

    def job(self, tokens, swap, index):
        """A job file of its own (data, seed, output folder)."""
        self.runs += 1
        d = os.path.join(self.root, f"run{self.runs}-{index}")
        os.makedirs(d, exist_ok=True)
        data = os.path.join(self.root, f"data-{index}.jsonl")
        write_data(data, self.args.vocab, 48, 1100, seed=index)
        path = os.path.join(d, "job.toml")
        with open(path, "w") as f:
            f.write(JOB.format(name=f"j{index}", store=self.args.store, data=data,
                               seq_len=tokens, steps=self.args.steps, seed=index,
                               out=os.path.join(d, "out"), swap=swap, ring=2))
        return path, os.path.join(d, "out", "stats.jsonl")

    def train(self, jobs, label):
        """One lorastream-worker train of `jobs` (a group when several); per job its steps."""
        cmd = [os.path.join(self.args.bin, "lorastream-worker"), "train", "--device",
               self.args.device, "--no-resume"] + [j for j, _ in jobs]
        logf = os.path.join(self.root, f"{label}.log")
        start = time.time()
        with open(logf, "w") as f:
            rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT)
        if rc != 0:
            sys.exit(f"{label}: exit {rc}, see {logf}")
        return [read_stats(s) for _, s in jobs], time.time() - start, estimate_gib(logf)

    def side_by_side(self, jobs, label):
        procs = []
        for i, (j, _) in enumerate(jobs):
            f = open(os.path.join(self.root, f"{label}-{i}.log"), "w")
            procs.append((subprocess.Popen(
                [os.path.join(self.args.bin, "lorastream-worker"), "train", "--device",
                 self.args.device, "--no-resume", j], stdout=f, stderr=subprocess.STDOUT), f))
        for p, f in procs:
            rc = p.wait()
            f.close()
            if rc != 0:
                sys.exit(f"{label}: exit {rc}")
        return [read_stats(s) for _, s in jobs]


def estimate_gib(log_path):
    """The plan's memory estimate for the whole group, from the worker's log line
    ("stream plan ...; estimate X GiB at the peak: ..."); None when it is not there."""
    with open(log_path) as f:
        m = re.search(r"estimate ([0-9.]+) GiB at the peak", f.read())
    return float(m.group(1)) if m else None


def read_stats(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def steady(steps, warmup):
    return steps[warmup:] if len(steps) > warmup else steps


def med(steps, key, warmup):
    return statistics.median(s[key] for s in steady(steps, warmup))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--tokens", default="512,2048")
    ap.add_argument("--swap", type=int, default=12)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    b = Bench(args)
    rows, results = [], {}
    lengths = [int(t) for t in args.tokens.split(",")]
    short = min(lengths)  # the length of the bytes, one-after-another and processes rows
    for tokens in lengths:
        for plan, swap in ((f"{args.swap} streamed, ring 2", args.swap), ("resident", 0)):
            one = None
            for k in (1, 2, 4):
                jobs = [b.job(tokens, swap, i) for i in range(k)]
                stats, _, estimate = b.train(jobs, f"t{tokens}-s{swap}-k{k}")
                step = med(stats[0], "step_seconds", args.warmup)
                agg = sum(tokens / med(s, "step_seconds", args.warmup) for s in stats)
                one = agg if k == 1 else one
                r = {"tokens": tokens, "plan": plan, "k": k, "step_ms": step * 1e3,
                     "agg_tok_s": agg, "vs_one": agg / one,
                     "h2d_gb": med(stats[0], "h2d_bytes", args.warmup) / 1e9,
                     "h2d_busy_ms": med(stats[0], "h2d_busy_seconds", args.warmup) * 1e3,
                     "stall_ms": med(stats[0], "stall_seconds", args.warmup) * 1e3,
                     "peak_gib": max(s["peak_device_bytes"] for s in stats[0]) / 2**30,
                     "estimate_gib": estimate}
                results[(tokens, swap, k)] = r
                log(json.dumps(r))
                rows.append(r)
    # The floor of each streamed group: the copy at the bandwidth the run measured, or the
    # resident group's step, whichever is longer.
    for r in rows:
        swap = args.swap if r["plan"] != "resident" else 0
        resident = results.get((r["tokens"], 0, r["k"]))
        bw = r["h2d_gb"] / (r["h2d_busy_ms"] / 1e3) if r["h2d_busy_ms"] > 0 else 0
        copy_ms = r["h2d_gb"] / bw * 1e3 if bw > 0 else 0
        r["floor_ms"] = max(copy_ms, resident["step_ms"] if resident else 0)
        r["swap"] = swap
    # Bytes per step with K = 8 (and those above): the same for every K.
    bytes_k = {k: results[(short, args.swap, k)]["h2d_gb"] for k in (1, 2, 4)}
    jobs8 = [b.job(short, args.swap, i) for i in range(8)]
    stats8, _, _ = b.train(jobs8, f"t{short}-bytes-k8")
    bytes_k[8] = med(stats8[0], "h2d_bytes", args.warmup) / 1e9
    # What a user can do today: 4 jobs one after another, 4 processes side by side.
    serial_wall = 0.0
    serial_tokens = 0
    for i in range(4):
        job = b.job(short, args.swap, i)
        stats, _, _ = b.train([job], f"t{short}-serial-{i}")
        serial_wall += sum(s["step_seconds"] for s in stats[0])
        serial_tokens += sum(s["tokens"] for s in stats[0])
    procs = b.side_by_side([b.job(short, args.swap, i) for i in range(4)], f"t{short}-procs4")
    procs_agg = sum(short / med(s, "step_seconds", args.warmup) for s in procs)
    group4 = results[(short, args.swap, 4)]

    md = ["# Job groups on one GPU", "",
          f"`tools/gpu/bench_group.sh OUT` ({args.steps} steps per job, medians of steps "
          f"{args.warmup + 1}-{args.steps}; batch 1, rank 16 on all seven projections, bf16, "
          f"store `{args.store}`, device {args.device})", "",
          "| tokens | plan | jobs | group step ms | aggregate tok/s | vs one job | H2D GB/step "
          "| stall ms | peak GiB | estimated GiB | floor ms |",
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        md.append(f"| {r['tokens']} | {r['plan']} | {r['k']} | {r['step_ms']:.1f} | "
                  f"{r['agg_tok_s']:.0f} | {r['vs_one']:.2f}x | {r['h2d_gb']:.2f} | "
                  f"{r['stall_ms']:.1f} | {r['peak_gib']:.2f} | "
                  f"{'—' if r['estimate_gib'] is None else format(r['estimate_gib'], '.2f')} | "
                  f"{r['floor_ms']:.1f} |")
    md += ["", f"Bytes copied per step at {short} tokens, streamed: " +
           ", ".join(f"K={k}: {v:.2f} GB" for k, v in sorted(bytes_k.items())), ""]
    serial_rate = serial_tokens / serial_wall if serial_wall > 0 else 0
    md += [f"At {short} tokens, streamed, 4 jobs: one group {group4['agg_tok_s']:.0f} tok/s; "
           f"one after another {serial_rate:.0f} tok/s (their steps' time); "
           f"4 processes side by side {procs_agg:.0f} tok/s (sum of each process's median).", ""]
    with open(os.path.join(args.out, "bench_group.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    with open(os.path.join(args.out, "bench_group.json"), "w") as f:
        json.dump({"rows": rows, "bytes_per_step_gb": bytes_k, "serial_tok_s": serial_rate,
                   "procs4_tok_s": procs_agg}, f, indent=1)
    log("\n".join(md))


if __name__ == "__main__":
    main()
