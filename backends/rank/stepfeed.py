"""Rank 0's metrics rows handed to a caller's callback (`tinypipe.train`), and the callback's request to stop.

A `LocalFeed` holds the callback and lives in the caller's process: ranks that run there (one CPU rank,
threads, torchrun's rank 0) call `put` with each row `StepLog` writes to metrics.jsonl. Spawned ranks get a
`ProcessFeed` instead, a queue and an event made for spawning: rank 0 puts its rows on the queue, and the
launcher relays them to the `LocalFeed` while it waits for the ranks (`relay`), and sets the event when
the callback asked to stop. Every rank reads `stop_asked` at the end of each window beside Ctrl-C's event,
so a stop finishes that window, checkpoints and saves the model at the stop, as Ctrl-C does.

The callback stops the run by returning False or raising `StopTraining`; any other exception it raises
stops the run the same way and is kept in `error`, for the caller to raise once the ranks have finished.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from tinypipe.common.errors import StopTraining

Row = dict[str, Any]


class LocalFeed:
    """The callback, called in this process with each row; what it asked for."""

    def __init__(self, callback: Callable[[Row], object]) -> None:
        self.callback = callback
        self.rows: list[Row] = []  # every row the callback was given, in step order
        self.error: BaseException | None = None  # what the callback raised, other than StopTraining
        self._stop = threading.Event()

    def put(self, row: Row) -> None:
        """Give `row` (a copy) to the callback, unless it has failed."""
        self.rows.append(dict(row))
        if self.error is not None:
            return
        try:
            if self.callback(dict(row)) is False:
                self._stop.set()
        except StopTraining:
            self._stop.set()
        except Exception as exc:  # noqa: BLE001 - kept and raised by the caller after the run stops cleanly
            self.error = exc
            self._stop.set()

    def stop_asked(self) -> bool:
        return self._stop.is_set()


class ProcessFeed:
    """Spawned ranks' side of a `LocalFeed`: a queue of rows and a stop event, both made by the spawn context."""

    def __init__(self, queue: Any, stop: Any) -> None:
        self.queue, self.stop = queue, stop

    def put(self, row: Row) -> None:
        self.queue.put(dict(row))

    def stop_asked(self) -> bool:
        return bool(self.stop.is_set())

    def relay(self, local: LocalFeed) -> None:
        """The launcher's side: every row queued so far to `local`'s callback; its stop request to the ranks."""
        while not self.queue.empty():
            local.put(self.queue.get())
        if local.stop_asked():
            self.stop.set()


def spawned_feed() -> ProcessFeed:
    """A `ProcessFeed` for ranks spawned by torch.multiprocessing (start method spawn)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    return ProcessFeed(ctx.SimpleQueue(), ctx.Event())
