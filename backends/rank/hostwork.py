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

import gc
import os
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import torch

# Python's GIL switch interval while a rank runs, and while `tinypipe profile` times what a run does.
# The worker releases the GIL inside every torch op of a step (a Qwen3-1.7B block's step is ~150 of
# them) and must take it back from the thread that issues the device's work; a thread that wants the
# GIL waits up to the switch interval before the holder is made to drop it, and Python's default is
# 5 ms. Measured on one H200 (Qwen3-1.7B, async optimizer, 65,536 tokens per step, the same machine and
# profile; docs/performance.md): eager 2 x 2048 ran 13,596 tokens/s at 5 ms and
# 16,545 at 0.2 ms (x1.22), compiled 4 x 2048 27,843 and 28,992 (x1.04).
GIL_SWITCH_S = 2e-4


@contextmanager
def host_settings() -> Iterator[None]:
    """The rank's host settings for the block, the previous ones after: the GIL switch interval
    (GIL_SWITCH_S, or TINYPIPE_GIL_SWITCH_S from the environment) and, where TINYPIPE_THREADS is set,
    torch's intra-op threads instead of the rank's share (the two environment variables are A/B knobs:
    bench/device/fidelity_h200.sh's RUN ENV)."""
    switch, threads = sys.getswitchinterval(), torch.get_num_threads()
    sys.setswitchinterval(float(os.environ.get("TINYPIPE_GIL_SWITCH_S") or GIL_SWITCH_S))
    if os.environ.get("TINYPIPE_THREADS"):
        torch.set_num_threads(int(os.environ["TINYPIPE_THREADS"]))
    try:
        yield
    finally:
        sys.setswitchinterval(switch)
        torch.set_num_threads(threads)


@contextmanager
def gc_pauses(into: list[tuple[str, float, float]], min_s: float = 1e-3) -> Iterator[None]:
    """Within the block, append ("gc genN", start, end) on `time.perf_counter`'s clock to `into` for each of
    Python's garbage collections that took `min_s` or more: a collection holds the GIL, so every thread of
    the rank (the one issuing the device's work, the optimizer's) waits for it."""
    started: list[float] = []

    def note(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[:] = [time.perf_counter()]
        elif started:
            t1 = time.perf_counter()
            if t1 - started[0] >= min_s:
                into.append((f"gc gen{info.get('generation')}", started[0], t1))

    gc.callbacks.append(note)
    try:
        yield
    finally:
        gc.callbacks.remove(note)


# Python's cyclic garbage collector holds the GIL for a whole collection, so every thread of the rank
# waits for it. A full (generation 2) collection walks every tracked object: after `torch.compile`
# has built its graphs and guards that takes ~0.5 s, and it came once per compiled run, inside the
# timed iterations (H200, Qwen3-1.7B: the main thread stalled 481 ms issuing one FWD; at
# a window boundary the optimizer thread's last three steps took 0.93 s instead of 0.24 s). So after
# the first window (one iteration: the compile's) a rank with compiled blocks collects once and freezes
# what survives (`gc.freeze`: never walked again); later full collections walk only what training made
# since. An eager CUDA rank does the same: its full collections are shorter but came inside the timed
# iterations too (one of 274 ms in iteration 9 of an eager Qwen3-1.7B run at 2 x 2048). An eager CPU
# rank keeps Python's default: it stands in for a device in tests and the default job, and is not timed
# against a prediction of one.
# TINYPIPE_GC_FREEZE=0 keeps Python's default (an A/B knob, like the two of `host_settings`).
def settle_heap_enabled(compiled: bool, backend: str) -> bool:
    """Whether a rank of a run with these settings settles the heap after its first window (`settled_heap`)."""
    return (compiled or backend == "cuda") and os.environ.get("TINYPIPE_GC_FREEZE", "1") != "0"


@contextmanager
def settled_heap(into: list[tuple[str, float, float]]) -> Iterator[Callable[[], None]]:
    """A function that collects garbage once and freezes the survivors out of later collections,
    appending the span ("gc collect + freeze", start, end) to `into`; on leaving the block the
    frozen objects are collectable again (`gc.unfreeze`), so a process that runs again is as before."""

    def settle() -> None:
        t0 = time.perf_counter()
        gc.collect()
        gc.freeze()
        into.append(("gc collect + freeze", t0, time.perf_counter()))

    try:
        yield settle
    finally:
        gc.unfreeze()


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
