"""`LoopTimes`: a recomputed block's FWD and BWD timed inside the executor's loop, alone and beside the optimizer.

Why (H200, Qwen3-1.7B, recomputing schedule; per-action GPU times from run traces against the
isolated ones `tinypipe profile` takes per action): an eager block's BWD ran 5.84 ms with no OPT_STEP
running at its start and 6.45 ms with one, where the isolated recomputing BWD is 5.06 ms; a
compiled block's FWD ran 1.44 ms where the isolated one is 1.90 ms (with the graph; 1.84 without).
Back-to-back issue from the main thread, its polling, the copies on their streams and the host
optimizer thread's share of the GIL and the cores change the device's times both ways.

`tinypipe profile` (backends/profile/looptimes.py) runs one block's actions window after window
through `run_actions` (backends/profile/devloop.py) and keeps, per microbatch size, the median of
the FWDs and of the recomputing BWDs, with nothing else running on the host (`fwd_s`,
`recompute_bwd_s`) and while a host optimizer steps continuously on another thread
(`*_beside_optimizer_s`). `tinypipe.trace.KindProfile.compute_s` is the one rule that reads them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from tinypipe.jsonio import Fields


@dataclass(frozen=True)
class LoopTimes:
    """Median seconds of one block's actions issued back to back by the executor (module docstring).

    FWD is the recomputing schedule's forward (no graph), BWD the backward that re-runs it first."""

    fwd_s: float  # alone: nothing else running on the host
    recompute_bwd_s: float
    fwd_beside_optimizer_s: float  # while a host optimizer thread steps continuously
    recompute_bwd_beside_optimizer_s: float

    def compute_s(self, forward: bool, beside_optimizer: bool) -> float:
        """The FWD's or the BWD's time, alone or beside a running optimizer step."""
        if forward:
            return self.fwd_beside_optimizer_s if beside_optimizer else self.fwd_s
        return self.recompute_bwd_beside_optimizer_s if beside_optimizer else self.recompute_bwd_s

    def scaled(self, factor: float) -> LoopTimes:
        """Every time times `factor` (linear in tokens, as `KindProfile.scaled`)."""
        return LoopTimes(*(t * factor for t in (self.fwd_s, self.recompute_bwd_s, self.fwd_beside_optimizer_s,
                                                self.recompute_bwd_beside_optimizer_s)))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, f: Fields) -> LoopTimes:
        return cls(fwd_s=f.float("fwd_s", positive=True), recompute_bwd_s=f.float("recompute_bwd_s", positive=True),
                   fwd_beside_optimizer_s=f.float("fwd_beside_optimizer_s", positive=True),
                   recompute_bwd_beside_optimizer_s=f.float("recompute_bwd_beside_optimizer_s", positive=True))
