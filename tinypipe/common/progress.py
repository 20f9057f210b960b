"""Progress on stderr for work that takes seconds: a bar on a terminal, sparse lines otherwise.

On a terminal, phases and the bar share one line, rewritten in place and cleared at the end, so a
command that then fails shows only its `error:` line. Elsewhere (logs, pipes) nothing is written
during the first `QUIET_S` seconds, so quick commands and early mistakes print no progress at all;
after that each phase is one line, and a bar becomes a line at every quarter.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

QUIET_S = 2.0  # the threshold: anything slower than this shows progress
CLEAR = "\r\033[K"  # carriage return + erase line (VT100; every terminal tinypipe runs in)


class Progress:
    """Call `phase(text)` when a step starts and `progress(done, total)` within it; `close()` at the end."""

    def __init__(self, what: str, *, stream: TextIO | None = None) -> None:
        self.what = what
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self.t0 = time.monotonic()
        self._open = False  # a terminal line holds progress text
        self._quarter = -1
        self._pending: str | None = None  # a phase not yet shown (not a terminal, still quiet)

    def _quiet(self) -> bool:
        return time.monotonic() - self.t0 < QUIET_S

    def _line(self, text: str) -> None:
        if self.tty:
            self.stream.write(CLEAR + text)
            self._open = True
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def phase(self, text: str) -> None:
        """`text` says what starts now."""
        self._quarter = -1
        if self.tty or not self._quiet():
            self._pending = None
            self._line(text)
        else:
            self._pending = text

    def __call__(self, done: int, total: int) -> None:
        if not total:
            return
        if self.tty:
            n = int(30 * done / total)
            self._line(f"{self.what} [{'#' * n}{'.' * (30 - n)}] {done}/{total}")
            return
        quarter = 4 * done // total
        if quarter == self._quarter or self._quiet():
            return
        if self._pending is not None:
            self._line(self._pending)
            self._pending = None
        self._quarter = quarter
        self._line(f"{self.what}: {done}/{total}")

    def close(self) -> None:
        """Erase the terminal line (what follows is the result)."""
        if self._open:
            self.stream.write(CLEAR)
            self.stream.flush()
            self._open = False
