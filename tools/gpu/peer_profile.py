"""A peer's profiled steps as a table of kernels (torch.profiler), beside ours
(`lorastream-worker train --profile`): the bench_*_peer.py scripts' --profile PREFIX."""
import torch


def slug(name):
    return "".join(c if c.isalnum() else "_" for c in name).strip("_")


class StepWindow:
    """Profiles steps [first, first + steps) of a loop: call before(step) and after(step)
    around each step (0-based); writes PREFIX-<title>.md when the window closes."""

    def __init__(self, prefix, title, first, steps=2):
        self.prefix, self.title, self.first, self.steps = prefix, title, first, steps
        self.prof = None

    def before(self, step):
        if self.prefix and step == self.first:
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
