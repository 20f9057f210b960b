"""The host-memory guard: a thread that stops a rank as Ctrl-C does when the host's memory runs low.

The kernel's OOM killer ends a process that asks for memory the host no longer has with SIGKILL, and a
run it kills loses everything since its last checkpoint. Each rank runs an `RssGuard` beside its
training: every `sample_s` it reads what the host has left (`thismachine.host_available_now`:
MemAvailable, or the cgroup's limit less what the cgroup holds, whichever is smaller), and under the
floor it sets the rank's stop event, the one its SIGINT handler sets (`rankprocess.process_main`,
`spawn._run_here`). The rank finishes its window, writes its checkpoint (streamed from the live
tensors: no copy) and stops (`worker`), without saving the model at the stop (that takes a copy of the
rank's weights); `run` ends with one line saying what was left, the floor and the worker's RSS, and that
`--resume --out DIR` continues, exit code 2.

The floor and the sampling period come from the environment, for tests and for hosts that need
another floor: `TINYPIPE_RSS_FLOOR_BYTES` (a size, e.g. 4GiB; 0 turns the guard off) and
`TINYPIPE_RSS_SAMPLE_S`.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

from tinypipe.common.errors import InputError
from tinypipe.common.table import gib
from tinypipe.common.units import GIB, parse_bytes
from tinypipe.describe.thismachine import HostMemoryHere, host_available_now, host_total_here

from .rank_state import rss_now

# What the host must keep left while a run trains: the share of its memory (MemTotal, or the cgroup's limit
# when smaller) and a least figure for small hosts. 2% of the 1-GPU H200 machine's 125.8 GiB is 2.5 GiB:
# room for what a rank does between the trip and its stop (the rest of its window, whose steps repeat the
# memory use of steps already run, and a checkpoint streamed from the live tensors) and for the page
# cache and other processes meanwhile. 1 GiB is about two CPU workers' own memory (the default job's two
# workers: 939 MiB of RSS beside a predicted host peak of 2.3 MiB).
FLOOR_FRACTION = 0.02
FLOOR_MIN_BYTES = GIB
SAMPLE_S = 0.5  # reading /proc/meminfo costs microseconds; a run's host memory grows over seconds
FLOOR_ENV, SAMPLE_ENV = "TINYPIPE_RSS_FLOOR_BYTES", "TINYPIPE_RSS_SAMPLE_S"


def default_floor_bytes(total_bytes: int | None) -> int:
    """The floor on a host of `total_bytes` (None: unknown, the least floor)."""
    return max(FLOOR_MIN_BYTES, math.ceil(FLOOR_FRACTION * (total_bytes or 0)))


@dataclass(frozen=True)
class GuardSettings:
    """The guard's floor (None: `default_floor_bytes` of this host, found where the rank runs) and period."""

    floor_bytes: int | None = None
    sample_s: float = SAMPLE_S

    @classmethod
    def from_env(cls) -> GuardSettings:
        """The settings `TINYPIPE_RSS_FLOOR_BYTES` and `TINYPIPE_RSS_SAMPLE_S` give; InputError on a bad value."""
        floor = os.environ.get(FLOOR_ENV, "").strip()
        period = os.environ.get(SAMPLE_ENV, "").strip()
        try:
            sample_s = float(period) if period else SAMPLE_S
        except ValueError:
            sample_s = -1.0
        if not (0 < sample_s < math.inf):
            raise InputError(f"{SAMPLE_ENV}={period}: expected a positive number of seconds")
        return cls(parse_bytes(floor, FLOOR_ENV) if floor else None, sample_s)


@dataclass(frozen=True)
class LowMemory:
    """What a rank's guard saw when it stopped the run."""

    rank: int
    available_bytes: int
    source: str  # where `available_bytes` comes from (HostMemoryHere.source)
    floor_bytes: int
    rss_bytes: int  # the rank's process, resident

    def what(self) -> str:
        return (f"host memory ran low: {gib(self.available_bytes)} left ({self.source}), under the guard's floor of "
                f"{gib(self.floor_bytes)}, with rank {self.rank}'s worker at {gib(self.rss_bytes)} RSS")


def stop_line(low: LowMemory, out: str | None) -> str:
    """The one line a run stopped by its guard ends with: what the guard saw and how to continue."""
    from ..save import checkpoint

    found = checkpoint.find(out) if out else None
    if found is None:
        return f"{low.what()}; the run stopped as Ctrl-C stops it, without a checkpoint (--keep-checkpoints 0)"
    step = checkpoint.read_record(found)["step"]
    return (f"{low.what()}; the run stopped as Ctrl-C stops it, with a checkpoint at step {step}: free host memory "
            f"(or take a policy with a smaller host peak), then continue with --resume --out {out}")


class RssGuard:
    """A thread that sets `stop` once the host has less than the floor left; a context manager (one sample on
    entry, so a host already under the floor stops the rank at its first chance, then one every `sample_s`)."""

    def __init__(self, stop: threading.Event, settings: GuardSettings = GuardSettings(), *, rank: int = 0,
                 read: Callable[[], HostMemoryHere | None] = host_available_now) -> None:
        self.stop = stop
        self.floor_bytes = (default_floor_bytes(host_total_here()) if settings.floor_bytes is None
                            else settings.floor_bytes)
        self.sample_s = settings.sample_s
        self.rank = rank
        self.read = read
        self.tripped: LowMemory | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"rank{rank}-rss-guard", daemon=True)

    def check(self) -> bool:
        """One sample: True, with `tripped` filled in and `stop` set, when the host has less than the floor left."""
        here = self.read()
        if here is None or here.bytes >= self.floor_bytes:
            return False
        self.tripped = LowMemory(self.rank, here.bytes, here.source, self.floor_bytes, rss_now()[0])
        self.stop.set()
        return True

    def _watch(self) -> None:
        while not self._done.wait(self.sample_s):
            if self.check():
                return

    def __enter__(self) -> RssGuard:
        if self.floor_bytes > 0 and not self.check():  # a floor of 0: off
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()
