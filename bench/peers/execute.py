"""Running one peer process to completion or to its time limit: its own process group (so a timeout ends
it and every process it started), its output in a log file, and the log's last lines for the record."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

TERM_GRACE_S = 10.0  # after SIGTERM, this long to exit before SIGKILL
TAIL_LINES = 40
TAIL_LINE_CHARS = 400


@dataclass(frozen=True)
class Outcome:
    """How a peer process ended: `timed_out`, its exit code (negative: the signal that ended it; None if
    it could not be started), its wall time, and its log's last lines."""

    timed_out: bool
    returncode: int | None
    wall_s: float
    tail: list[str]

    def describe(self) -> str:
        """One line: how it ended."""
        if self.timed_out:
            return f"killed after the {self.wall_s:.0f} s time limit"
        if self.returncode is None:
            return "could not be started"
        if self.returncode < 0:
            try:
                name = signal.Signals(-self.returncode).name
            except ValueError:
                name = f"signal {-self.returncode}"
            hint = " (the kernel's OOM killer, if host memory ran out)" if name == "SIGKILL" else ""
            return f"killed by {name}{hint}"
        return f"exit code {self.returncode}"


def execute(argv: Sequence[str], env: Mapping[str, str], *, timeout_s: float, log: Path,
            cwd: Path | None = None) -> Outcome:
    """Run `argv` with its output in `log`; past `timeout_s` its process group gets SIGTERM, then SIGKILL."""
    t0 = time.monotonic()
    with open(log, "wb") as out:
        try:
            proc = subprocess.Popen(list(argv), env=dict(env), cwd=cwd, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as exc:
            out.write(f"could not start {argv[0]}: {exc}\n".encode())
            proc = None
        timed_out = False
        if proc is not None:
            try:
                proc.wait(timeout=max(0.0, timeout_s))
            except subprocess.TimeoutExpired:
                timed_out = True
                _signal_group(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=TERM_GRACE_S)
                except subprocess.TimeoutExpired:
                    _signal_group(proc.pid, signal.SIGKILL)
                    proc.wait()
            _signal_group(proc.pid, signal.SIGKILL)  # what it started and left behind (its group is its own)
    return Outcome(timed_out, None if proc is None else proc.returncode, time.monotonic() - t0, tail(log))


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def tail(log: Path, lines: int = TAIL_LINES) -> list[str]:
    """The last `lines` non-empty lines of `log` (a progress bar's carriage returns split lines too)."""
    try:
        text = log.read_bytes().decode(errors="replace")
    except OSError:
        return []
    rows = [r.rstrip() for r in text.replace("\r", "\n").split("\n") if r.strip()]
    return [r if len(r) <= TAIL_LINE_CHARS else r[:TAIL_LINE_CHARS] + " ..." for r in rows[-lines:]]
