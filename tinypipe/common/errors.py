"""User-facing errors: each prints as one line and makes the command exit with code 2."""

from __future__ import annotations


class TinypipeError(Exception):
    """Base of every error a user can cause; the CLI prints `error: <message>` and exits 2."""


class InputError(TinypipeError):
    """Bad input: a file, a field or an option. The message names what and where."""


class CapacityError(TinypipeError):
    """A memory capacity (GPU or host) would be exceeded; the message names device, action and bytes."""


class ScheduleError(TinypipeError):
    """A schedule that fails validation; the message carries the grid with the failing action marked."""


class StopTraining(Exception):
    """Raised by a `tinypipe.train` callback: the run stops as Ctrl-C stops it (checkpoint, model at the stop)."""
