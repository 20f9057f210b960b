"""The run's tokens/s: the mean over the iterations after compilation and the optimizer's first step."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from tinypipe.backends.launch.steady import steady_iteration, steady_summary  # noqa: E402
from tinypipe.ir.timeline import Record, Timeline  # noqa: E402


def _tl(iter_s: list[float], first_steps_end_s: float) -> Timeline:
    """One FWD per iteration ending at the running sum of `iter_s`; iteration 0's OPT_STEP ends at
    `first_steps_end_s`; later steps end within their own iteration."""
    recs, t = [], 0.0
    for i, d in enumerate(iter_s):
        recs.append(Record(2 * i, "g0.compute", "FWD", "F0", 0, 0, i, t, t + d))
        end = first_steps_end_s if i == 0 else t + d
        recs.append(Record(2 * i + 1, "host.optim", "OPT_STEP", "O0", 0, None, i, t + d / 2, end))
        t += d
    return Timeline(tuple(recs), source="cpu")


def test_steady_skips_compilation_and_the_first_step() -> None:
    """Iteration 0 (compilation) is skipped, and so is every iteration that began before iteration 0's
    optimizer steps ended; the rest are averaged."""
    # iteration 0 ends at 5; its step ends at 6.5, inside iteration 1 (5..7): iterations 2.. are steady
    tl = _tl([5.0, 2.0, 1.0, 1.0, 1.0], 6.5)
    assert steady_iteration(tl) == (1.0, 2)
    assert tl.steady_iteration_s() == pytest.approx(1.25)  # the old rule: the mean after the first
    seconds, how = steady_summary(tl)
    assert seconds == 1.0 and how.startswith("mean of 3 steady step(s) after skipping the first 2")
    # its step ended with the iteration: only iteration 0 is skipped
    assert steady_iteration(_tl([5.0, 2.0, 1.0], 5.0)) == (1.5, 1)


def test_too_short_a_run_falls_back() -> None:
    """No iteration after the first step: the mean after the first; one iteration: its own time."""
    assert steady_iteration(_tl([5.0, 2.0, 1.0], 100.0)) == (1.5, 1)
    assert steady_iteration(_tl([3.0], 3.0)) == (3.0, 0)
    assert steady_summary(_tl([3.0], 3.0))[1] == "its only step"
