#!/usr/bin/env python3
"""Checks tools/gpu/bench_moe.sh's nf4 run on the CPU (ctest `bench_moe`), with tiny-moe:
- its table prints no group figures for a group whose jobs never all trained together;
- a plan by hand beside the planner's: its row, its floor at the streamed run's bandwidth;
- the streamed and nf4 runs train every step; the NF4 store's figures: fewer bytes than the
  checkpoint, its PSS within 1.1x of its bytes, 28 weights quantised per block (the 4 attention
  projections and every expert's 3), the ratios line against 18 GB;
- the store extrapolated from 2 of tiny-moe's 4 blocks equals the 4-block store's bytes;
- a store that fails to serve: the table says why, the streamed row stays, the script exits 1;
- nothing of the stores left in /dev/shm.

Usage: check_bench_moe.py BUILD_DIR
"""
import glob
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        failures.append(what)


def bench(build, tmp, label, **env):
    """bench_moe.sh on the CPU with tiny-moe into tmp/label: (exit status, bench_moe.md,
    store_nf4.json or {}, the stores' segments left in /dev/shm)."""
    base = dict(os.environ, LORASTREAM_BUILD_DIR=build, MOE_BENCH_PRESET="tiny-moe",
                MOE_BENCH_LAYERS="4", MOE_BENCH_TOKENS="64", MOE_BENCH_DEVICE="cpu",
                MOE_BENCH_DTYPE="f32", MOE_BENCH_BUDGET="600MiB", MOE_BENCH_NF4_BUDGET="600MiB",
                MOE_BENCH_STEPS="3", MOE_BENCH_WARMUP="1", MOE_BENCH_TIMEOUT="300",
                MOE_BENCH_WORK=os.path.join(tmp, label, "work"))
    base.update(env)
    out = os.path.join(tmp, label)
    r = subprocess.run([os.path.join(ROOT, "tools", "gpu", "bench_moe.sh"), out], env=base,
                       capture_output=True, text=True, timeout=900)
    print(f"--- {label}\n{r.stdout[-4000:]}{r.stderr[-2000:]}")
    md_path = os.path.join(out, "moe", "bench_moe.md")
    md = open(md_path).read() if os.path.exists(md_path) else ""
    store_path = os.path.join(out, "moe", "store_nf4.json")
    store = json.load(open(store_path)) if os.path.exists(store_path) else {}
    left = glob.glob("/dev/shm/lorastream.moe-bench-nf4-*")
    return r.returncode, md, store, left


def rows(md):
    return {line.split("|")[1].strip(): line for line in md.splitlines()
            if line.startswith("| lorastream")}


def check_group_apart(tmp):
    """bench_moe_table.py on a group run whose four jobs never trained together (the first
    alone, then the other three as a group, as a budget that holds three makes them): no group
    step, tokens/s or ratio from one job's or three jobs' steps; exit 1. Then the same jobs all
    joined at once: the group's figures."""
    out = os.path.join(tmp, "apart")
    os.makedirs(out)
    for name, step in [("streamed", 0.5)] + [(f"group{i}", 0.6) for i in range(1, 5)]:
        with open(os.path.join(out, f"stats_{name}.jsonl"), "w") as f:
            for i in range(3):
                f.write(json.dumps({"step": i + 1, "step_seconds": step, "h2d_bytes": 1e9,
                                    "h2d_busy_seconds": 0.02, "stall_seconds": 0.01,
                                    "peak_device_bytes": 2**30, "loss": 1.0}) + "\n")
    table = [sys.executable, os.path.join(ROOT, "tools", "gpu", "bench_moe_table.py"), out,
             "--steps", "3", "--warmup", "1", "--budget", "600MiB"]

    def run(counts):
        with open(os.path.join(out, "train_group.log"), "w") as f:
            for i, n in enumerate(counts):
                f.write(f"job group{i + 1}: joins the group ({n} job{'' if n == 1 else 's'})\n")
        return subprocess.run(table, capture_output=True, text=True)

    r = run([1, 1, 2, 3])
    row = rows(r.stdout).get("lorastream, a group of 4 within 600MiB", "")
    check(r.returncode == 1, f"a group that never formed: exit 1 (got {r.returncode})")
    check("did not train as one group: at most 3 of 4 jobs together" in row,
          f"its row says so: {row!r}")
    check("tokens/s / one streamed job's" not in r.stdout and "group of 4 within" not in
          r.stdout.split("| ratio |")[-1], "no group ratio")
    r = run([1, 2, 3, 4])
    check(r.returncode == 0 and "| group of 4: tokens/s / one streamed job's | 3.33 |" in r.stdout,
          f"all four together: the group's ratios (exit {r.returncode})")


def check_hand_plan(tmp):
    """bench_moe_table.py with a plan by hand beside the planner's: its row, its PCIe floor at
    the streamed run's calibrated bandwidth (a hand plan calibrates nothing), the planner's
    step over the hand plan's."""
    out = os.path.join(tmp, "hand")
    os.makedirs(out)
    for name, step, h2d in (("streamed", 0.5, 1e9), ("hand", 0.6, 2e9)):
        with open(os.path.join(out, f"stats_{name}.jsonl"), "w") as f:
            for i in range(3):
                f.write(json.dumps({"step": i + 1, "step_seconds": step, "h2d_bytes": h2d,
                                    "h2d_busy_seconds": 0.1, "stall_seconds": 0.01,
                                    "peak_device_bytes": 2**30, "loss": 1.0}) + "\n")
    with open(os.path.join(out, "train_streamed.log"), "w") as f:
        f.write("stream plan from gpu_memory_budget 600.0 MiB by the cost model (10 candidates; "
                "block forward 1.00 ms, H2D 10.0 GB/s): 2 of 4 blocks streamed [0 2] through 1 "
                "ring slot; resident [1 3]; predicted 500.0 ms per step (resident 400.0 ms); "
                "estimate 0.50 GiB at the peak\n")
    with open(os.path.join(out, "train_hand.log"), "w") as f:
        f.write("stream plan from blocks_to_swap 2: 2 of 4 blocks streamed [0 2] through 2 ring "
                "slots; resident [1 3]; estimate 0.55 GiB at the peak\n")
    hand = "blocks_to_swap = 2; ring_size = 2"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "gpu", "bench_moe_table.py"),
                        out, "--steps", "3", "--warmup", "1", "--budget", "600MiB", "--hand",
                        hand], capture_output=True, text=True)
    row = rows(r.stdout).get(f"lorastream, a plan by hand ({hand})", "")
    check(r.returncode == 0, f"a hand plan beside the planner's: exit 0 (got {r.returncode})")
    check("| 2 of 4 blocks streamed through 2 ring slots; 2 resident | 3/3 | 0.600 |" in row
          and "| 0.200 |" in row, f"its row, its floor 2 GB at 10 GB/s: {row!r}")
    check(f"| a plan by hand ({hand}) / its PCIe floor | 3.000 |" in r.stdout
          and "| the planner's plan within 600MiB / the plan by hand | 0.833 |" in r.stdout,
          "its ratios: 0.6 s over 0.2 s, 0.5 s over 0.6 s")


def main():
    build = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "build")
    with tempfile.TemporaryDirectory() as tmp:
        check_group_apart(tmp)
        check_hand_plan(tmp)
    nf4_row = "lorastream on an NF4 store within 600MiB"
    with tempfile.TemporaryDirectory() as tmp:
        rc, md, store, left = bench(build, tmp, "four", MOE_BENCH_RUNS="streamed,nf4")
        check(rc == 0, f"streamed and nf4 runs exit 0 (got {rc})")
        found = rows(md)
        for name in ("lorastream within 600MiB", nf4_row):
            check(name in found and "| 3/3 |" in found[name], f"row {name!r} with 3 of 3 steps")
        size = {k: float(store.get(k, "nan")) for k in ("checkpoint_bytes", "store_bytes",
                                                          "pss_bytes")}
        check(0 < size["store_bytes"] < size["checkpoint_bytes"],
              f"the NF4 store is smaller than the checkpoint: {size}")
        check(0.9 <= size["pss_bytes"] / size["store_bytes"] <= 1.1,
              f"the PSS of its segments within 1.1x of its bytes: {size}")
        check(store.get("quantised", "").startswith("quantising 112 weights"),
              f"4 blocks x (4 attention projections + 8 experts x 3) quantised: "
              f"{store.get('quantised')!r}")
        check(re.search(r"\| NF4 store RAM 0\.00 GB \(PSS, 4 layers\) \(target ≤ 18 GB: yes\); "
                        r"peak .* \| ≤ 18 GB; within 16 GiB \|", md) is not None,
              "the ratios line: the store's RAM against 18 GB, the peak against the budget")
        check("Extrapolated" not in md, "no extrapolation at the preset's own depth")
        check(not left, f"nothing left in /dev/shm: {left}")

        # Two of tiny-moe's four blocks, extrapolated to four: the four-block store's bytes.
        rc, md, _, left = bench(build, tmp, "two", MOE_BENCH_RUNS="nf4", MOE_BENCH_LAYERS="2")
        m = re.search(r"Extrapolated to 4 blocks \(not measured: .*\): [\d.]+ GB \((\d+) bytes\)",
                      md)
        check(rc == 0 and m is not None, f"two blocks extrapolated to four (exit {rc})")
        check(m is not None and float(m.group(1)) == size["store_bytes"],
              f"the extrapolation {m.group(1) if m else None} bytes = the four-block store's "
              f"{size['store_bytes']:.0f}")
        check(not left, f"nothing left in /dev/shm: {left}")

        # A store that cannot be served: the table says why, the streamed row stays.
        rc, md, store, left = bench(build, tmp, "fail", MOE_BENCH_RUNS="streamed,nf4",
                                    MOE_BENCH_NF4_ARGS="--no-such-option")
        found = rows(md)
        check(rc == 1, f"a failed store: exit 1 (got {rc})")
        check("serve exited" in store.get("error", ""), f"the error: {store.get('error')!r}")
        check(nf4_row in found and "| failed: the store failed, serve exited" in found[nf4_row],
              "the nf4 row says why")
        check("lorastream within 600MiB" in found and "| 3/3 |" in found["lorastream within 600MiB"],
              "the streamed row is unaffected")
        check("NF4 store RAM — (the store failed" in md
              and "peak — (the job did not train)" in md,
              "the ratios line says the store failed")
        check(not left, f"nothing left in /dev/shm: {left}")
    print(f"{len(failures)} failed" if failures else "all passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
