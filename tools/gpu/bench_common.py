"""What the GPU benchmarks' tables and peers share (tools/gpu/bench_*_table.py, bench_*_peer.py).

The table helpers need nothing beyond the standard library (the tables run where torch is
absent); the peer helpers import torch when called.
"""
import gc
import json
import os
import signal
import statistics
import time
import traceback


def read_stats(path):
    """The rows of a job's stats.jsonl (one dict per step); [] when the file is missing."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def median_after(rows, key, warmup):
    """The median of rows[key] (key None: of the rows themselves) after the first `warmup` rows
    (all of them when no more); NaN when there are none."""
    rows = rows[warmup:] if len(rows) > warmup else rows
    return (statistics.median(r if key is None else r[key] for r in rows) if rows
            else float("nan"))


def fmt(x, digits=3):
    return "—" if x is None or x != x else f"{x:.{digits}f}"


def ratio(a, b):
    return None if a is None or b is None or a != a or b != b or b == 0 else a / b


def plan_summary(path):
    """The `plan-summary k=v ...` line of a DiT family's plan (the output of `lorastream-worker
    plan`, or a training log, whose messages write their newlines as \\x0a), as floats; {}
    when there is none."""
    if not os.path.exists(path):
        return {}
    for line in open(path, errors="replace"):
        for part in line.replace("\\x0a", "\n").split("\n"):
            if part.startswith("plan-summary "):
                return {k: float(v) for k, v in (kv.split("=") for kv in part.split()[1:])}
    return {}


class Deadline(Exception):
    """A peer configuration ran past its time."""


def slug(name):
    return "".join(c if c.isalnum() else "_" for c in name).strip("_")


class StepWindow:
    """A peer's profiled steps as a table of kernels (torch.profiler), beside ours
    (`lorastream-worker train --profile`): the bench_*_peer.py scripts' --profile PREFIX.
    Profiles steps [first, first + steps) of a loop: call before(step) and after(step) around
    each step (0-based); writes PREFIX-<title>.md when the window closes ("" PREFIX: none)."""

    def __init__(self, prefix, title, first, steps=2):
        self.prefix, self.title, self.first, self.steps = prefix, title, first, steps
        self.prof = None

    def before(self, step):
        if self.prefix and step == self.first:
            import torch

            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                           torch.profiler.ProfilerActivity.CUDA])
            self.prof.start()

    def after(self, step):
        if self.prof is None or step != self.first + self.steps - 1:
            return
        self.prof.stop()
        table = self.prof.key_averages().table(sort_by="self_device_time_total", row_limit=50,
                                               max_name_column_width=90)
        with open(f"{self.prefix}-{slug(self.title)}.md", "w") as f:
            f.write(f"# Profile of {self.steps} steps: {self.title}\n\n```\n{table}\n```\n")
        self.prof = None


def time_steps(step, steps, warmup, device, deadline_s=0, label="", profile=""):
    """Runs `step()` (one training step; returns the loss as a tensor or a float) `steps` times,
    the device synchronised after each (with `profile` a PREFIX, the two steps after the warm-up
    profiled into PREFIX-<label>.md: StepWindow), and returns the steps' seconds, their median after
    `warmup`, the losses and the device's peak allocated memory (GiB; None on the CPU). With
    deadline_s > 0, raises Deadline when the steps together run past it (checked by a timer
    signal, so a compilation that runs past it is stopped too)."""
    import torch

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)

    def expired(*_):
        raise Deadline(f"past its deadline of {deadline_s:g} s")

    old = signal.signal(signal.SIGALRM, expired) if deadline_s > 0 else None
    if deadline_s > 0:
        signal.setitimer(signal.ITIMER_REAL, deadline_s)
    times, losses = [], []
    try:
        window = StepWindow(profile, label, warmup)
        for i in range(steps):
            window.before(i)
            start = time.perf_counter()
            loss = step()
            if cuda:
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
            window.after(i)
            losses.append(float(loss))
            print(f"  {label}: step {i + 1}/{steps} {times[-1]:.3f} s loss {losses[-1]:.4f}",
                  flush=True)
    finally:
        if deadline_s > 0:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
    timed = times[warmup:] if len(times) > warmup else times
    return {"steps": len(times), "step_seconds": statistics.median(timed), "all_seconds": times,
            "losses": losses, "loss": losses[-1],
            "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None}


def lora_params_f32(model):
    """The trainable (LoRA) parameters, made f32 (the master weights lorastream keeps)."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.dtype != torch.float32:
            p.data = p.data.float()
    return params


def record_run(report, cfg, fn, out_path):
    """Runs `fn()` (a peer configuration; returns its figures) and records the figures, or the
    error that stopped it (out of memory, a backend missing, past its deadline: the other
    configurations still run), as report["runs"][cfg["name"]] with the configuration; prints
    it and writes the report to out_path (after each configuration, so that a run stopped by
    a timeout keeps what ran)."""
    import torch

    try:
        report["runs"][cfg["name"]] = {"config": cfg, **fn()}
    except Exception as e:  # noqa: BLE001 - recorded as the configuration's row
        report["runs"][cfg["name"]] = {"config": cfg, "error": f"{type(e).__name__}: {e}"[:600]}
        if not isinstance(e, (torch.OutOfMemoryError, Deadline)):
            traceback.print_exc()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    r = report["runs"][cfg["name"]]
    print(cfg["name"], json.dumps({k: v for k, v in r.items() if k not in ("config", "losses")}),
          flush=True)
    write_report(report, out_path)


def write_report(report, out_path, started=None):
    """Writes a peer's report as JSON; with `started` (time.time() at its start), as the
    finished report, with its wall_seconds (a report without them was stopped)."""
    if started is not None:
        report["wall_seconds"] = time.time() - started
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1)


def fastest_config(report, pred=lambda c: True):
    """A copy of the configuration of the fastest recorded run whose configuration passes
    `pred`; None when none ran."""
    done = [r for r in report["runs"].values() if "step_seconds" in r and pred(r["config"])]
    return dict(min(done, key=lambda r: r["step_seconds"])["config"]) if done else None


def load_musubi_offloading(path):
    """musubi-tuner's offloading module, imported from its file: src/musubi_tuner/modules/
    custom_offloading_utils.py of a checkout of https://github.com/kohya-ss/musubi-tuner (it
    needs torch only; it is no part of this repository)."""
    import importlib.util

    if not os.path.isfile(path):
        raise FileNotFoundError(f"musubi-tuner's custom_offloading_utils.py: no file {path}")
    spec = importlib.util.spec_from_file_location("musubi_custom_offloading_utils", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def musubi_offloader(offloading, block_type, blocks, swap, ring, device):
    """musubi-tuner's H2D-only block swap (LoRAStreamOffloader: pinned host masters streamed into
    `ring` device slots) over `blocks`, built as musubi-tuner's models build it (BlockSwapConfig,
    create_offloader: `swap` blocks streamed, at even intervals; a full backward hook on each
    block that prefetches during the backward). `offloading`: load_musubi_offloading's module.

    Call it with the base frozen and before peft wraps the blocks' Linear modules: the offloader
    streams a block's modules whose class name ends in Linear, found (and cached) by name.
    musubi-tuner's own LoRA patches those modules' forward and leaves them in place; peft wraps
    them in modules of its own, also named Linear (holding LoRA's trainable ones). The frozen
    originals (peft's base layers) are cached here first, so that the offloader streams what
    musubi-tuner's would.

    The driver then calls, as musubi-tuner's models do, wait_for_block(i) before block i's
    forward, submit_move_blocks_forward(blocks, i) after it (outside its gradient checkpoint),
    and prepare_block_devices_before_forward(blocks) once before the first step.
    offloader.h2d_bytes_copied counts the bytes its copier has submitted host to device."""
    config = offloading.BlockSwapConfig(device=device, supports_backward=True,
                                        use_pinned_memory=True, h2d_only=True, ring_size=ring)
    offloader = offloading.create_offloader(block_type, blocks, len(blocks), swap, config)
    for i in offloader.stream_idx:
        offloader._modules(i)
    offloader.h2d_bytes_copied = 0
    submit = offloader.copier.submit

    def counted(key, dst_flat, src_flat, *rest, **kwargs):
        offloader.h2d_bytes_copied += src_flat.numel() * src_flat.element_size()
        return submit(key, dst_flat, src_flat, *rest, **kwargs)

    offloader.copier.submit = counted
    return offloader


def h2d_bandwidth(nbytes, device, repeats=5):
    """Host-to-device bandwidth (bytes/s) of one copy of `nbytes` from pinned host memory (the
    median of `repeats` timed copies after one untimed), as a streaming offloader copies a
    block."""
    import torch

    with torch.cuda.device(device):
        src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        seconds = []
        for _ in range(repeats):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 1e3)
        del src, dst
    return nbytes / statistics.median(seconds)
