"""`LoopTimes`: a recomputed block's FWD and BWD timed inside the executor's loop, alone and beside the optimizer.

Why (H200, Qwen3-1.7B, recomputing schedule; per-action GPU times from run traces against the
isolated ones `tinypipe profile` takes per action): an eager block's BWD ran 5.84 ms with no OPT_STEP
running at its start and 6.45 ms with one, where the isolated recomputing BWD is 5.06 ms; a
compiled block's FWD ran 1.44 ms where the isolated one is 1.90 ms (with the graph; 1.84 without).
Back-to-back issue from the main thread, its polling, the copies on their streams and the host
optimizer thread's share of the GIL and the cores change the device's times both ways.

`tinypipe profile` (backends/profile/measure_loop.py) runs one block's actions window after window
through `run_actions` (backends/profile/devloop.py) and keeps, per microbatch size, the median of
the FWDs and of the recomputing BWDs, with nothing else running on the host (`fwd_s`,
`recompute_bwd_s`) and while a host optimizer steps continuously on another thread
(`*_beside_optimizer_s`). `tinypipe.describe.trace.KindProfile.compute_s` is the one rule that reads them.

Issue gaps (`*_gap_s`, optional: 0 in traces before them): the mean time the compute stream stood idle
before a FWD / BWD that followed another one back to back, waiting for the main thread to issue it (an
action's record starts when the stream reaches its start marker, so the time the thread spends between
two actions -- the executor's loop, its sleeps, the GIL -- falls between the records). The simulator
starts such an action no earlier than that gap after the lane's previous FWD / BWD ended
(`KindProfile.issue_gap_s`). Why: in the eager async Qwen3-1.7B run on an H200 (2 x 2048) the compute
stream waited 0.30 s of each 5.2 s iteration for the main thread, on average 0.36 ms before a block's BWD
and 0.08 ms before its FWD with no optimizer step running, 0.69 and 0.26 ms beside one; the sync run
0.14 s (docs/fidelity.md). The mean, not the median: the waits add up.

Issue times (`*_issue_s`, optional: 0 in traces before them): the median time the main thread spends
issuing a FWD / BWD (its handler; the executor's `RunLog.issue`). An eager layer's kernels are launched
during its issue, so where issuing takes longer than the device's work, FWDs and BWDs issued back to back
run at the issue's pace, and `compute_s` charges the larger of the two. Why: in the eager sync Qwen3-1.7B
run on an H200 (2 x 2048, 16 microbatches; its trace's `g0.issue` thread) a block's FWD took 2.41 ms
to issue and its record 2.45 ms on the device, against 1.37 ms for the first microbatch's FWD, which
was issued while the device waited for the layer's upload; the main thread issued for 3.73 s of the
3.99 s iteration. The profile's loop measured the device's FWD at
1.45 ms and its issue at 2.17 ms (2.51 beside a stepping optimizer). Compiled blocks issue in less
than their device time (1.0 / 2.7 ms against 1.6 / 4.9 ms), and so do eager ones at 4 x 2048.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from tinypipe.common.jsonio import Fields


@dataclass(frozen=True)
class LoopTimes:
    """Median seconds of one block's actions issued back to back by the executor (module docstring).

    FWD is the recomputing schedule's forward (no graph), BWD the backward that re-runs it first."""

    fwd_s: float  # alone: nothing else running on the host
    recompute_bwd_s: float
    fwd_beside_optimizer_s: float  # while a host optimizer thread steps continuously
    recompute_bwd_beside_optimizer_s: float
    # the compute stream's mean wait for the main thread before a back-to-back FWD / BWD (module docstring)
    fwd_gap_s: float = 0.0
    recompute_bwd_gap_s: float = 0.0
    fwd_gap_beside_optimizer_s: float = 0.0
    recompute_bwd_gap_beside_optimizer_s: float = 0.0
    # the main thread's time issuing a FWD / BWD (its handler, from the executor's `RunLog.issue`; 0: not measured)
    fwd_issue_s: float = 0.0
    recompute_bwd_issue_s: float = 0.0
    fwd_issue_beside_optimizer_s: float = 0.0
    recompute_bwd_issue_beside_optimizer_s: float = 0.0

    def compute_s(self, forward: bool, beside_optimizer: bool) -> float:
        """The FWD's or the BWD's time, alone or beside a running optimizer step: the device's, or the main
        thread's issue where that is longer (module docstring: back to back, the device waits for it)."""
        return max(self.device_s(forward, beside_optimizer), self.issue_s(forward, beside_optimizer))

    def device_s(self, forward: bool, beside_optimizer: bool) -> float:
        """The FWD's or the BWD's time on the device, alone or beside a running optimizer step."""
        return float(getattr(self, _field("", forward, beside_optimizer)))

    def gap_s(self, forward: bool, beside_optimizer: bool) -> float:
        """The issue gap before a back-to-back FWD or BWD, alone or beside a running optimizer step."""
        return float(getattr(self, _field("_gap", forward, beside_optimizer)))

    def issue_s(self, forward: bool, beside_optimizer: bool) -> float:
        """The main thread's time issuing a FWD or BWD, alone or beside a running optimizer step (0: not measured)."""
        return float(getattr(self, _field("_issue", forward, beside_optimizer)))

    def scaled(self, factor: float) -> LoopTimes:
        """Every time times `factor` (linear in tokens, as `KindProfile.scaled`); the issue gaps and issue
        times, the host's time between and inside two actions' issue, kept."""
        return replace(self, **{k: getattr(self, k) * factor for k in COMPUTE_FIELDS})

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k in COMPUTE_FIELDS or v}

    @classmethod
    def from_json(cls, f: Fields) -> LoopTimes:
        return cls(**{k: f.float(k, positive=True) for k in COMPUTE_FIELDS},
                   **{k: f.float(k, 0.0, minimum=0.0) for k in (*GAP_FIELDS, *ISSUE_FIELDS)})


def _field(what: str, forward: bool, beside_optimizer: bool) -> str:
    """The LoopTimes field of `what` ("": the device's time, "_gap", "_issue") for a FWD or a BWD, alone or beside."""
    return ("fwd" if forward else "recompute_bwd") + what + ("_beside_optimizer_s" if beside_optimizer else "_s")


def _fields(what: str) -> tuple[str, ...]:
    return tuple(_field(what, forward, beside) for beside in (False, True) for forward in (True, False))


COMPUTE_FIELDS = _fields("")
GAP_FIELDS = _fields("_gap")
ISSUE_FIELDS = _fields("_issue")
