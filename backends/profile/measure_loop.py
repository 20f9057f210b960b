"""A block's recomputing FWD and BWD timed inside the executor's loop, alone and beside a stepping host optimizer.

Why: `layers.py` times each action on its own (dispatched, then synchronised), and a run's times
differ from those both ways (`tinypipe.describe.looptimes`: an eager block's BWD 15-27% slower in a run, a
compiled block's FWD 27% faster). So per microbatch size, on one `devloop.DeviceLoop` of that size
(one decoder block's LOAD, FWDs, recomputing BWDs, GRAD_OUT and EVICT, window after window through
`executor.run_actions` from this thread, as a rank's main thread issues them):

- one untimed warm-up window (the streams, the first allocations, a compiled block's graphs for
  this shape), which also says how long a window takes; then `windows_for` picks how many windows
  to time per condition (LOOP_BUDGET_S of them, at least MIN_WINDOWS, at most the profile's repeat);
- alone: that many windows with nothing else running on the host;
- beside the optimizer: that many windows while a `HostWorker` thread steps a host state of the
  same block without a pause (`optim.Stepper`: the run's own host state under the default policy's
  host_memory, the gradients delivered before each step as GRAD_OUT does). Its first step (which
  allocates the AdamW moments) ends before the first window starts and it steps on until the last
  window has ended, so every action of those windows starts while a step (or the delivery between
  two) runs: the condition the simulator's `*_beside_optimizer_s` stands for.

Each action's time is its executor record (`RunLog.records`: CUDA events on its stream on CUDA, the
host clock around the work on the CPU stand-in); the medians of the FWDs and of the BWDs are kept.
The issue times (`tinypipe.describe.looptimes`, `*_issue_s`; CUDA only, `issue_fields`): the main thread's time in each
FWD's / BWD's handler (`RunLog.issue`), the median per kind and condition.
The issue gaps (`tinypipe.describe.looptimes`, `*_gap_s`): before each FWD / BWD whose predecessor on the compute
stream is a FWD / BWD (not the cycle's first FWD, which waits for its LOAD), its record's start minus
that predecessor's end, 0 if it overlapped; the mean per kind and condition is kept.
The thread count is the caller's (`command.py`: one rank's, as the optimizer's profile uses).
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, replace

from tinypipe.describe.looptimes import LoopTimes
from tinypipe.describe.model import LayerKind
from tinypipe.describe.trace import ProfileTrace
from tinypipe.ir.schedule import Kind
from tinypipe.ir.timeline import Record
from tinypipe.policy import Policy
from tinypipe.policy.modes import HostMemory

from ..rank.executor import RunLog
from .devloop import DeviceLoop
from .measure_layers import LayerBench
from .optim import Stepper

LOOP_BUDGET_S = 0.5  # seconds of timed windows per microbatch size and condition (alone / beside)
MIN_WINDOWS = 2  # at least this many per condition (unless the profile's repeat is lower)
LAYOUT: HostMemory = Policy().host_memory  # the host memory layout the stepping optimizer uses: the default policy's


def windows_for(warm_s: float, max_windows: int) -> int:
    """How many windows to time per condition after a warm-up window of `warm_s`: LOOP_BUDGET_S of them, at
    least MIN_WINDOWS, at most `max_windows` (which wins, but never fewer than one)."""
    fit = int(LOOP_BUDGET_S / warm_s) if warm_s > 0 else max_windows
    return max(1, min(max_windows, max(MIN_WINDOWS, fit)))


@dataclass(frozen=True)
class LoopSamples:
    """Every timed FWD and BWD of one microbatch size, seconds each, and how they were taken."""

    windows: int  # per condition
    steps: int  # optimizer steps that ran beside the timed windows (the warm-up step not counted)
    fwd_alone_s: tuple[float, ...]
    bwd_alone_s: tuple[float, ...]
    fwd_beside_s: tuple[float, ...]
    bwd_beside_s: tuple[float, ...]
    # issue gaps before back-to-back FWDs / BWDs (module docstring); empty: none measured
    fwd_gap_alone_s: tuple[float, ...] = ()
    bwd_gap_alone_s: tuple[float, ...] = ()
    fwd_gap_beside_s: tuple[float, ...] = ()
    bwd_gap_beside_s: tuple[float, ...] = ()
    # the main thread's issue of each FWD / BWD (`RunLog.issue`); empty: none measured
    fwd_issue_alone_s: tuple[float, ...] = ()
    bwd_issue_alone_s: tuple[float, ...] = ()
    fwd_issue_beside_s: tuple[float, ...] = ()
    bwd_issue_beside_s: tuple[float, ...] = ()

    def times(self) -> LoopTimes:
        def med(times: tuple[float, ...]) -> float:
            return statistics.median(times) if times else 0.0

        def mean(gaps: tuple[float, ...]) -> float:
            return statistics.fmean(gaps) if gaps else 0.0

        return LoopTimes(fwd_s=med(self.fwd_alone_s), recompute_bwd_s=med(self.bwd_alone_s),
                         fwd_beside_optimizer_s=med(self.fwd_beside_s),
                         recompute_bwd_beside_optimizer_s=med(self.bwd_beside_s),
                         fwd_gap_s=mean(self.fwd_gap_alone_s), recompute_bwd_gap_s=mean(self.bwd_gap_alone_s),
                         fwd_gap_beside_optimizer_s=mean(self.fwd_gap_beside_s),
                         recompute_bwd_gap_beside_optimizer_s=mean(self.bwd_gap_beside_s),
                         fwd_issue_s=med(self.fwd_issue_alone_s), recompute_bwd_issue_s=med(self.bwd_issue_alone_s),
                         fwd_issue_beside_optimizer_s=med(self.fwd_issue_beside_s),
                         recompute_bwd_issue_beside_optimizer_s=med(self.bwd_issue_beside_s))


def _durations(logs: list[RunLog], kind: Kind) -> tuple[float, ...]:
    return tuple(r.duration_s for log in logs for r in log.records if r.kind == kind.value)


def issue_fields(alone: list[RunLog], beside: list[RunLog]) -> dict[str, tuple[float, ...]]:
    """LoopSamples' issue times of each FWD and BWD, alone and beside the optimizer. CUDA only: on the CPU
    stand-in the issue runs the work itself, so it is the record plus the executor's overhead, and kept
    unscaled across microbatch sizes (`LoopTimes.scaled`) it would overcharge smaller ones."""
    return {"fwd_issue_alone_s": issue_times(alone, Kind.FWD), "bwd_issue_alone_s": issue_times(alone, Kind.BWD),
            "fwd_issue_beside_s": issue_times(beside, Kind.FWD), "bwd_issue_beside_s": issue_times(beside, Kind.BWD)}


def issue_times(logs: list[RunLog], kind: Kind) -> tuple[float, ...]:
    """The main thread's issue time of each `kind` action (`RunLog.issue`)."""
    out = []
    for log in logs:
        ids = {r.id for r in log.records if r.kind == kind.value}
        out += [b - a for rid, a, b in log.issue if rid in ids]
    return tuple(out)


def issue_gaps(logs: list[RunLog], kind: Kind) -> tuple[float, ...]:
    """Before each `kind` action whose predecessor on its stream (records by start) is a FWD / BWD: its start
    minus that predecessor's end, 0 when they overlap (module docstring)."""
    compute = (Kind.FWD.value, Kind.BWD.value)
    out = []
    for log in logs:
        by_stream: dict[str, list[Record]] = {}
        for r in sorted(log.records, key=lambda r: (r.start_s, r.id)):
            by_stream.setdefault(r.resource, []).append(r)
        for recs in by_stream.values():
            for prev, r in zip(recs, recs[1:]):
                if r.kind == kind.value and prev.kind in compute:
                    out.append(max(0.0, r.start_s - prev.end_s))
    return tuple(out)


def has_block(bench: LayerBench) -> bool:
    """Whether the model has a decoder block to loop (every shipped model has)."""
    return bench.spec.layers[bench.layers[LayerKind.BLOCK.value]].kind is LayerKind.BLOCK


def time_loop(bench: LayerBench, loop: DeviceLoop, *, max_windows: int) -> LoopSamples:
    """Time `loop`'s FWDs and BWDs alone, then beside a continuously stepping optimizer (module docstring)."""
    t0 = time.perf_counter()
    loop.window()
    n = windows_for(time.perf_counter() - t0, max_windows)
    alone = [loop.window() for _ in range(n)]
    s = Stepper(bench.host.master(loop.layer), layer=loop.layer, host_memory=LAYOUT, dtype=bench.dtype, tied=None)
    go, stop = threading.Event(), threading.Event()
    steps = [0]

    def keep_stepping() -> None:
        s.deliver()
        s.state.step(s.layer)  # warm-up: allocates the moments; the windows start after it
        go.set()
        while not stop.is_set():
            s.deliver()
            s.state.step(s.layer)
            steps[0] += 1

    fut = s.worker.submit(lambda: None, keep_stepping)
    try:
        while not go.wait(0.05):
            if fut.done():
                fut.result()  # the warm-up step failed: its error
                raise RuntimeError("the loop's optimizer thread stopped before its first step ended")
        beside = [loop.window() for _ in range(n)]
    finally:
        stop.set()
        s.close()
    fut.result()  # re-raises a step's error
    return LoopSamples(windows=n, steps=steps[0], fwd_alone_s=_durations(alone, Kind.FWD),
                       bwd_alone_s=_durations(alone, Kind.BWD), fwd_beside_s=_durations(beside, Kind.FWD),
                       bwd_beside_s=_durations(beside, Kind.BWD), fwd_gap_alone_s=issue_gaps(alone, Kind.FWD),
                       bwd_gap_alone_s=issue_gaps(alone, Kind.BWD), fwd_gap_beside_s=issue_gaps(beside, Kind.FWD),
                       bwd_gap_beside_s=issue_gaps(beside, Kind.BWD),
                       **(issue_fields(alone, beside) if bench.device.type == "cuda" else {}))


def describe(samples: LoopSamples, loop: DeviceLoop, threads: int) -> str:
    """What a trace's `source` says about its block's `loop` times: how they were measured, and the counts."""
    return (f"the block's recomputing FWD and BWD issued back to back by the executor: {loop.describe}, at "
            f"{threads} torch thread(s); after one warm-up window, the medians of each action's executor record "
            f"over {samples.windows} window(s) per condition ({len(samples.fwd_alone_s)} FWD, "
            f"{len(samples.bwd_alone_s)} BWD each): fwd_s, recompute_bwd_s with nothing else running on the host; "
            f"*_gap_s the mean wait of the compute stream before a FWD / BWD that followed another one "
            f"({len(samples.fwd_gap_alone_s)} FWD, {len(samples.bwd_gap_alone_s)} BWD each); "
            f"*_beside_optimizer_s while a host-worker thread stepped the block's host state ({LAYOUT} layout) "
            f"without a pause from before the first window to after the last ({samples.steps} steps)")


def with_loop(trace: ProfileTrace, times: LoopTimes, note: str) -> ProfileTrace:
    """`trace` with `times` on its block kind and `note` in its source."""
    block = LayerKind.BLOCK.value
    kinds = {**trace.kinds, block: replace(trace.kinds[block], loop=times)}
    return replace(trace, kinds=kinds, source=f"{trace.source}. Loop (block): {note}")
