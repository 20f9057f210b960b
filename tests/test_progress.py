"""Progress on stderr: a line rewritten in place on a terminal, sparse lines elsewhere, nothing for quick work."""

from __future__ import annotations

import io

import pytest

from tinypipe.common import progress
from tinypipe.common.progress import CLEAR, Progress


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def _clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [100.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    return now


def test_not_a_terminal_quiet_first_then_a_line_per_phase_and_quarter(monkeypatch: pytest.MonkeyPatch) -> None:
    """In a log: nothing during the first QUIET_S seconds (quick commands and early errors stay
    clean); then the pending phase, and one line per quarter of the work."""
    now = _clock(monkeypatch)
    s = _Stream(tty=False)
    p = Progress("search", stream=s)
    p.phase("search: stage 1")
    p(1, 100)
    assert s.getvalue() == ""
    now[0] += progress.QUIET_S
    for done in range(2, 101):
        p(done, 100)
    p.phase("writing")
    p.close()
    assert s.getvalue().splitlines() == ["search: stage 1", "search: 2/100", "search: 25/100", "search: 50/100",
                                         "search: 75/100", "search: 100/100", "writing"]


def test_a_terminal_line_is_rewritten_and_cleared(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a terminal: phases and the bar share one line from the start, and close() erases it."""
    _clock(monkeypatch)
    s = _Stream(tty=True)
    p = Progress("search", stream=s)
    p.phase("loading")
    p(15, 30)
    p.close()
    assert s.getvalue() == (CLEAR + "loading" + CLEAR + "search [" + "#" * 15 + "." * 15 + "] 15/30" + CLEAR)
    assert "\n" not in s.getvalue()
