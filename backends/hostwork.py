"""The rank's host worker: OPT_STEPs run on a thread of their own, in schedule order, beside GPU dispatch.

Issue 9's trace: with the optimizer step run by the thread that issues GPU work, the compute stream
starved for 0.15-0.27 s at every backward layer boundary. Here the dispatch thread hands each step
to this worker and goes on issuing; the worker first waits for the device work the step reads (the
gradients' download; uploads still reading the layer's host memory are the host state's to wait
for), then runs it. One worker per
rank, so steps keep the `host.optim` list order; torch's intra-op threads (set per rank from the
cores the rank gets) parallelise each step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class HostWorker:
    """A single thread that runs submitted host actions one after another, timing each."""

    def __init__(self, name: str = "host-optim") -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def submit(self, before: Callable[[], Any], work: Callable[[], Any]) -> Future[tuple[float, float]]:
        """Run `before()` (waiting for what the work reads), then `work()`; the future holds the
        work's (start, end) on `time.perf_counter`'s clock, or its exception."""

        def body() -> tuple[float, float]:
            before()
            t0 = time.perf_counter()
            work()
            return t0, time.perf_counter()

        return self._pool.submit(body)

    def close(self) -> None:
        """Wait for submitted work and stop the thread."""
        self._pool.shutdown(wait=True)
