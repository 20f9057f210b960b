"""A run's steady iteration time: the mean over iterations after compilation and the optimizer's first step.

Iteration 0 carries compilation (`--compile`), the caching allocator's and the pinned pools' first
allocations and the host's first touch of its pages. The iteration during which iteration 0's
optimizer steps still run carries their first touch of the optimizer state (AdamW creates its
moments at the first step): an 8B run on an H200 printed 7,749 tokens/s as the mean of the
iterations after the first, where its steady iterations ran at 9,094 (issue 26). So the steady
iterations are those that begin after every optimizer step of the first iteration has ended.
"""

from __future__ import annotations

import statistics
from typing import Any

from tinypipe.ir.kinds import Kind


def steady_iteration(tl: Any) -> tuple[float, int]:
    """(mean seconds of the steady iterations of Timeline `tl`, how many iterations were skipped before them).

    Fewer than one steady iteration: the mean after the first (`Timeline.steady_iteration_s`), 1 skipped;
    a one-iteration run: its only time, 0 skipped."""
    times = tl.iteration_times_s()
    if len(times) < 2:
        return (times[0] if times else 0.0), 0
    ends = tl.iteration_ends_s()
    first = min(r.iteration for r in tl.records)
    steps_end = max((r.end_s for r in tl.records if r.kind == Kind.OPT_STEP.value and r.iteration == first),
                    default=0.0)
    skip = next((i for i in range(1, len(times)) if ends[i - 1] >= steps_end), len(times))
    if skip >= len(times):
        return statistics.fmean(times[1:]), 1
    return statistics.fmean(times[skip:]), skip


def steady_summary(tl: Any) -> tuple[float, str]:
    """`steady_iteration` of `tl`, and how it was taken in words for the run's summary."""
    seconds, skipped = steady_iteration(tl)
    if skipped == 0:
        return seconds, "its only step"
    return seconds, (f"mean of {len(tl.iteration_times_s()) - skipped} steady step(s) after skipping the first "
                     f"{skipped}: compilation, first allocations, the optimizer's first step")
