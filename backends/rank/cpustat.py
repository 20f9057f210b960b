"""The host's stolen CPU time: what a virtual machine's hypervisor gave to other guests.

On virtual H200 machines (16 vCPUs) `top` showed 5-8% steal for seconds at a time while a profile
timed the host optimizer, and that profile's compact block step ran 72 ms where the profiles before
and after it on the same machine ran 33-35 ms. A step is ~150
torch ops, each split over the rank's threads and joined at a barrier: a vCPU paused under any one
thread holds up the op, so a few percent of steal can double a step. Profiles and runs report the
steal they saw (`Steal`), so a slow measurement says why.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PROC_STAT = Path("/proc/stat")
# A stolen share above this is reported (profile, run summary, bench/fidelity.py): the slow profile above
# ran while `top` showed 5-8%, and a run with slow first iterations lost 2.3% overall.
NOTABLE_STEAL = 0.01


def cpu_jiffies(path: Path = PROC_STAT) -> tuple[int, int] | None:
    """(all, stolen) CPU time of the host since boot, in clock ticks summed over CPUs; None where the
    system has no /proc/stat (not Linux) or its first line is not the `cpu` total."""
    try:
        return cpu_line_jiffies(path.read_text().split("\n", 1)[0])
    except OSError:
        return None


def cpu_line_jiffies(line: str) -> tuple[int, int] | None:
    """(all, stolen) clock ticks of one `cpu` total line of /proc/stat; None for any other line."""
    first = line.split()
    if not first or first[0] != "cpu" or len(first) < 9:
        return None
    ticks = [int(x) for x in first[1:]]
    # user nice system idle iowait irq softirq steal [guest guest_nice: already inside user and nice]
    return sum(ticks[:8]), ticks[7]


@dataclass
class Steal:
    """Stolen share of the host's CPU time from its creation to `share()`; None where unknown."""

    path: Path = PROC_STAT

    def __post_init__(self) -> None:
        self.start = cpu_jiffies(self.path)

    def share(self) -> float | None:
        return stolen_share(self.start, cpu_jiffies(self.path))


def stolen_share(start: tuple[float, float] | None, end: tuple[float, float] | None) -> float | None:
    """The stolen share of the CPU time between two (all, stolen) readings; None where either is unknown
    or no time passed."""
    if start is None or end is None or end[0] <= start[0]:
        return None
    return (end[1] - start[1]) / (end[0] - start[0])
