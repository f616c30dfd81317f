#!/usr/bin/env python3
"""Several GPUs, one store: `lorastream up` with one worker per GPU against one job on one GPU.

On a CUDA machine with two GPUs (tools/gpu/build_and_test.sh runs it as the step `multi`):
for each sequence length, runs

  single: lorastream up --device cuda:0                 --job A
  dual:   lorastream up --device cuda:0 --device cuda:1 --job A --job B

against one store serving a 16-layer llama-3-8b-shaped checkpoint (bf16, the one
tools/gpu/bench_stream.sh synthesises), with 12 of 16 blocks streamed through a ring of 2. While
the dual run trains, it samples the proportional set size (PSS) of every lorastream process and
of their mappings of the store's shared memory. Writes OUT/multi_gpu.md (tables and the
commands), OUT/multi_gpu.json, and keeps each run's logs and stats under OUT/multi/.

Figures: per-job steady-state tokens/s (median over the steps after the warm-up), the dual
run's aggregate (sum over jobs) against the single run, the same on wall-clock (all tokens over
first start to last end, including each job's set-up), each worker's stall per step, and the host
RAM held against the size of the base.
"""
import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time


def log(msg):
    print(msg, flush=True)


def write_data(path, vocab, docs, doc_tokens, seed=7):
    if os.path.exists(path):
        return
    rng = random.Random(seed)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        for _ in range(docs):
            f.write(json.dumps({"input_ids": [rng.randrange(1, vocab) for _ in range(doc_tokens)]}))
            f.write("\n")
    os.replace(tmp, path)


# The benchmarks' job: rank 16 on all seven projections, batch 1, no checkpoints. `up` and
# `submit` set model.store and train.output_dir themselves ("placeholder" here).
JOB = """name = "{name}"
[model]
store = "{store}"
[data]
path = "{data}"
seq_len = {seq_len}
[lora]
rank = 16
alpha = 32.0
[optim]
lr = 1e-4
[train]
steps = {steps}
batch_size = 1
seed = {seed}
checkpoint_every = 0
output_dir = "{out}"
[stream]
blocks_to_swap = {swap}
ring_size = {ring}
"""


def shm_and_total_pss():
    """PSS (bytes) of every lorastream process: total, and of its /dev/shm mappings."""
    procs = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            exe = os.path.basename(argv[0].decode(errors="replace"))
            if not exe.startswith("lorastream"):
                continue
            role = exe + (" " + argv[1].decode(errors="replace") if len(argv) > 1 else "")
            if exe == "lorastream-worker" and b"--device" in argv:
                i = argv.index(b"--device")
                role += " " + argv[i + 1].decode(errors="replace")
            total = shm = 0
            in_shm = False
            with open(f"/proc/{pid}/smaps") as f:
                for line in f:
                    if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                        parts = line.split(None, 5)
                        in_shm = len(parts) > 5 and parts[5].startswith("/dev/shm/")
                    elif line.startswith("Pss:"):
                        kb = int(line.split()[1]) * 1024
                        total += kb
                        if in_shm:
                            shm += kb
            procs[int(pid)] = {"role": role, "pss": total, "shm_pss": shm}
        except (OSError, ValueError, IndexError):
            continue  # the process ended while we read it
    return procs


class Sampler(threading.Thread):
    """Samples every second while the cluster runs. A sample reads one process after another,
    so while a worker is still mapping the store the shares do not add up; the report takes the
    median over the samples in which the store and every worker map it."""

    def __init__(self, workers, period=1.0):
        super().__init__(daemon=True)
        self.workers = workers
        self.period = period
        self.stop = threading.Event()
        self.samples = []

    def run(self):
        while not self.stop.is_set():
            procs = shm_and_total_pss()
            mapping = [p for p in procs.values() if p["shm_pss"] > 0]
            if len(mapping) >= 1 + self.workers:
                self.samples.append({"shm_pss": sum(p["shm_pss"] for p in procs.values()),
                                     "pss": sum(p["pss"] for p in procs.values()),
                                     "procs": procs,
                                     "shm_dir_used": shutil.disk_usage("/dev/shm").used})
            self.stop.wait(self.period)

    def median(self):
        if not self.samples:
            return None
        ordered = sorted(self.samples, key=lambda x: x["shm_pss"])
        out = dict(ordered[len(ordered) // 2])
        out["samples"] = len(ordered)
        out["shm_pss_min"] = ordered[0]["shm_pss"]
        out["shm_pss_max"] = ordered[-1]["shm_pss"]
        return out


def read_stats(path, warmup):
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                rows.append(json.loads(line))
    steady = rows[warmup:] if len(rows) > warmup else rows
    med = lambda k: statistics.median(r[k] for r in steady)
    return {"steps": len(rows), "tokens": sum(r["tokens"] for r in rows),
            "tokens_per_s": med("tokens_per_second"), "step_s": med("step_seconds"),
            "stall_s": med("stall_seconds"), "h2d_busy_s": med("h2d_busy_seconds"),
            "h2d_gb": med("h2d_bytes") / 1e9}


def run_up(args, run_dir, devices, jobs, sample):
    cmd = [os.path.join(args.bin, "lorastream"), "up", "--model", args.model, "--run-dir", run_dir,
           "--no-watch", "--keep"]
    for d in devices:
        cmd += ["--device", d]
    for j in jobs:
        cmd += ["--job", j]
    log("$ " + " ".join(cmd))
    sampler = Sampler(len(devices)) if sample else None
    if sampler:
        sampler.start()
    t0 = time.time()
    out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.time() - t0
    if sampler:
        sampler.stop.set()
        sampler.join()
    log(out.stdout)
    m = re.search(r"coordinator ((?:tcp|ipc)://\S+?),", out.stdout)
    listing = []
    if m:
        q = subprocess.run([os.path.join(args.bin, "lorastream"), "--coordinator", m.group(1),
                            "jobs", "--json"], stdout=subprocess.PIPE, text=True)
        try:
            listing = json.loads(q.stdout)
        except ValueError:
            pass
    pids = os.path.join(run_dir, "pids")
    if os.path.exists(pids):
        subprocess.run("kill $(cat '%s'); sleep 3" % pids, shell=True)
    if out.returncode != 0:
        raise SystemExit(f"lorastream up failed ({out.returncode}); logs in {run_dir}/logs")
    if len(listing) != len(jobs):
        raise SystemExit(f"`lorastream jobs --json` listed {len(listing)} of {len(jobs)} jobs; "
                         f"logs in {run_dir}/logs")
    return {"wall_s": wall, "jobs": listing, "memory": sampler.median() if sampler else None}


def job_figures(listing, warmup):
    figures = []
    for job in listing:
        stats = read_stats(os.path.join(job["output_dir"], "stats.jsonl"), warmup)
        stats.update({"name": job["name"], "device": job["worker_device"],
                      "started_at": job["started_at"], "finished_at": job["finished_at"],
                      "state": job["state"]})
        figures.append(stats)
    return figures


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap.add_argument("--bin", default=os.path.join(os.environ.get("LORASTREAM_BUILD_DIR",
                                                                 os.path.join(root, "build")),
                                                  "bin"))
    ap.add_argument("--model", default=os.path.join(os.environ.get("LORASTREAM_BENCH_DIR",
                                                                   "/tmp/lorastream-bench"),
                                                    "llama-3-8b-16"))
    ap.add_argument("--tokens", default="2048,8192", help="sequence lengths (comma list)")
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the medians")
    ap.add_argument("--swap", type=int, default=12)
    ap.add_argument("--ring", type=int, default=2)
    ap.add_argument("--devices", default="cuda:0,cuda:1")
    args = ap.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    work = os.path.join(args.out, "multi")
    os.makedirs(work, exist_ok=True)
    if not os.path.exists(os.path.join(args.model, "config.json")):
        subprocess.run([os.path.join(args.bin, "lorastream-synth"), "--preset", "llama-3-8b",
                        "--layers", "16", "--out", args.model, "--presets-dir",
                        os.path.join(root, "configs", "models")], check=True)
    with open(os.path.join(args.model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    base_bytes = sum(os.path.getsize(os.path.join(args.model, n)) for n in os.listdir(args.model)
                     if n.endswith(".safetensors"))
    devices = args.devices.split(",")
    try:
        topo = subprocess.run(["nvidia-smi", "topo", "-m"], stdout=subprocess.PIPE,
                              text=True).stdout
    except OSError:
        topo = "(no nvidia-smi)"
    log(topo)

    # A short dual run first, not reported: the first CUDA job on a fresh machine pays for
    # loading kernels and warming the driver's caches, which would count against one side only.
    warm_len = min(512, *[int(t) for t in args.tokens.split(",")])
    warm_data = os.path.join(work, "data-warmup.jsonl")
    write_data(warm_data, vocab, docs=4, doc_tokens=warm_len)
    warm_jobs = []
    for i, name in enumerate(["a", "b"]):
        path = os.path.join(work, f"warmup_{name}.toml")
        with open(path, "w") as f:
            f.write(JOB.format(name=f"warmup-{name}", store="placeholder", data=warm_data,
                               seq_len=warm_len, steps=2, seed=i + 1, out="placeholder",
                               swap=args.swap, ring=args.ring))
        warm_jobs.append(path)
    run_up(args, os.path.join(work, "warmup"), devices, warm_jobs, sample=False)

    results = []
    for seq_len in [int(t) for t in args.tokens.split(",")]:
        data = os.path.join(work, f"data-{seq_len}.jsonl")
        write_data(data, vocab, docs=args.steps + 2, doc_tokens=seq_len)
        jobs = []
        for i, name in enumerate(["a", "b"]):
            path = os.path.join(work, f"multi_{name}_{seq_len}.toml")
            with open(path, "w") as f:
                f.write(JOB.format(name=f"multi-{name}-{seq_len}", store="placeholder", data=data,
                                   seq_len=seq_len, steps=args.steps, seed=i + 1,
                                   out="placeholder", swap=args.swap, ring=args.ring))
            jobs.append(path)
        single_dir = os.path.join(work, f"t{seq_len}-single")
        dual_dir = os.path.join(work, f"t{seq_len}-dual")
        single = run_up(args, single_dir, devices[:1], jobs[:1], sample=False)
        dual = run_up(args, dual_dir, devices, jobs, sample=True)
        s = job_figures(single["jobs"], args.warmup)
        d = job_figures(dual["jobs"], args.warmup)
        one = s[0]["tokens_per_s"]
        agg = sum(j["tokens_per_s"] for j in d)
        wall_one = s[0]["tokens"] / (s[0]["finished_at"] - s[0]["started_at"])
        wall_agg = sum(j["tokens"] for j in d) / (max(j["finished_at"] for j in d) -
                                                  min(j["started_at"] for j in d))
        results.append({"seq_len": seq_len, "single": s, "dual": d, "ratio_steady": agg / one,
                        "ratio_wall": wall_agg / wall_one, "memory": dual["memory"],
                        "up_wall_s": {"single": single["wall_s"], "dual": dual["wall_s"]}})
        log(f"seq {seq_len}: steady {agg:.0f} / {one:.0f} tokens/s = {agg / one:.3f}x; "
            f"wall {wall_agg:.0f} / {wall_one:.0f} = {wall_agg / wall_one:.3f}x")

    with open(os.path.join(args.out, "multi_gpu.json"), "w") as f:
        json.dump({"base_bytes": base_bytes, "results": results, "topology": topo}, f, indent=1)
    gb = lambda b: f"{b / 1e9:.2f}"
    lines = ["# Several GPUs, one store", "",
             f"Base: {args.model} ({gb(base_bytes)} GB of safetensors), rank 16 on all seven "
             f"projections, batch 1, {args.swap} of 16 blocks streamed, ring {args.ring}, "
             f"{args.steps} steps, medians over steps {args.warmup + 1}..{args.steps}.", "",
             "Command: `" + " ".join([os.path.relpath(__file__, root)] + sys.argv[1:]) + "`", "",
             "| tokens/seq | run | job | device | tokens/s | step s | stall s/step | "
             "H2D busy s/step | H2D GB/step |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for run in ("single", "dual"):
            for j in r[run]:
                lines.append(f"| {r['seq_len']} | {run} | {j['name']} | {j['device']} | "
                             f"{j['tokens_per_s']:.0f} | {j['step_s']:.3f} | {j['stall_s']:.3f} | "
                             f"{j['h2d_busy_s']:.3f} | {j['h2d_gb']:.2f} |")
    lines += ["", "| tokens/seq | aggregate/single, steady | aggregate/single, wall (with set-up) |",
              "|---|---|---|"]
    for r in results:
        lines.append(f"| {r['seq_len']} | {r['ratio_steady']:.3f} | {r['ratio_wall']:.3f} |")
    lines += ["", "Host RAM during the dual run (PSS counts a shared page once across the "
              "processes that map it; sampled each second, the median sample of those where the "
              "store and both workers map the base, with the range):", "",
              "| tokens/seq | base GB | /dev/shm used GB | PSS of shm mappings, all processes GB "
              "(range) | ratio to base | PSS of every lorastream process GB |",
              "|---|---|---|---|---|---|"]
    for r in results:
        p = r["memory"]
        if not p:
            lines.append(f"| {r['seq_len']} | {gb(base_bytes)} | no sample | | | |")
            continue
        lines.append(f"| {r['seq_len']} | {gb(base_bytes)} | {gb(p['shm_dir_used'])} | "
                     f"{gb(p['shm_pss'])} ({gb(p['shm_pss_min'])}..{gb(p['shm_pss_max'])}, "
                     f"{p['samples']} samples) | {p['shm_pss'] / base_bytes:.3f} | "
                     f"{gb(p['pss'])} |")
    lines += ["", "Per process in that sample:", "", "| tokens/seq | process | PSS GB | "
              "of which shm GB |", "|---|---|---|---|"]
    for r in results:
        procs = r["memory"]["procs"] if r["memory"] else {}
        for pid, p in sorted(procs.items(), key=lambda kv: kv[1]["role"]):
            lines.append(f"| {r['seq_len']} | {p['role']} | {gb(p['pss'])} | {gb(p['shm_pss'])} |")
    with open(os.path.join(args.out, "multi_gpu.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    log("\n".join(lines))


if __name__ == "__main__":
    main()
