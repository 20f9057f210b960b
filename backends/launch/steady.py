"""A run's steady iteration time: the mean over iterations after compilation and the optimizer's first step.

Iteration 0 carries compilation (`--compile`), the caching allocator's and the pinned pools' first
allocations and the host's first touch of its pages. The iteration during which iteration 0's
optimizer steps still run carries their first touch of the optimizer state (AdamW creates its
moments at the first step): an 8B run on an H200 printed 7,749 tokens/s as the mean of the
iterations after the first, where its steady iterations ran at 9,094 (issue 26). So the steady
iterations are those that begin after every optimizer step of the first iteration has ended.

Pauses that are not training (held-out evaluations between windows: `evaluation.EVAL_SPAN`) are taken
out of the iterations they fall in, so that the step time is training's alone. A pause is the time every
rank spends in it (`common`): a rank that evaluates while another still finishes its window's work does
not stop that work, and every rank's evaluation begins after its own window's last action, so the common
time lies within the next iteration.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from tinypipe.ir.kinds import Kind


def merged(spans: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """`spans` (start, end) as disjoint intervals in order (overlapping ones joined)."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def common(by_rank: Iterable[Sequence[tuple[float, float]]]) -> list[tuple[float, float]]:
    """The time every rank spends within its own `spans` (start, end): their intersection, as disjoint intervals."""
    out: list[tuple[float, float]] | None = None
    for spans in by_rank:
        mine = merged(spans)
        out = mine if out is None else [(max(a, c), min(b, d)) for a, b in out for c, d in mine
                                        if max(a, c) < min(b, d)]
    return out or []


def iteration_times(tl: Any, pauses: Sequence[tuple[float, float]] = ()) -> list[float]:
    """`tl.iteration_times_s()`, each less the time in `pauses` ((start, end) spans) within it."""
    joined = merged(pauses)
    out, prev = [], tl.start_s
    for t, end in zip(tl.iteration_times_s(), tl.iteration_ends_s()):
        out.append(t - sum(max(0.0, min(b, end) - max(a, prev)) for a, b in joined))
        prev = end
    return out


def steady_iteration(tl: Any, pauses: Sequence[tuple[float, float]] = ()) -> tuple[float, int]:
    """(mean seconds of the steady iterations of Timeline `tl`, how many iterations were skipped before them),
    the time in `pauses` left out (`iteration_times`).

    Fewer than one steady iteration: the mean after the first (`Timeline.steady_iteration_s`), 1 skipped;
    a one-iteration run: its only time, 0 skipped."""
    times = iteration_times(tl, pauses)
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


def steady_summary(tl: Any, pauses: Sequence[tuple[float, float]] = ()) -> tuple[float, str]:
    """`steady_iteration` of `tl` (less `pauses`), and how it was taken in words for the run's summary."""
    seconds, skipped = steady_iteration(tl, pauses)
    if skipped == 0:
        return seconds, "its only step"
    return seconds, (f"mean of {len(tl.iteration_times_s()) - skipped} steady step(s) after skipping the first "
                     f"{skipped}: compilation, first allocations, the optimizer's first step")
