"""Streams and events for the executor: CUDA streams on a GPU, a synchronous stand-in on the CPU.

torchgpipe's `CPUStream` idea: the executor speaks to one `Streams` object and never asks which
device it runs on. Each schedule resource (`g0.compute`, `g0.h2d`, ...) is a stream; an action
issued to it first makes the stream wait for the end markers of its dependencies, then records a
start marker, runs its handler with the stream current, and records an end marker.

- `CudaStreams`: one `torch.cuda.Stream` per resource (made once per rank: cuBLAS caches its
  workspace per stream), `torch.cuda.Event`s as markers. Issuing returns at once; the host only
  blocks in `host_wait` (host work that reads what a stream wrote, or the executor's bound on how
  far the host runs ahead of the GPU). Tensors used on a stream other than the one that allocated
  them are recorded on it (`use`), so the caching allocator does not reuse them early.
- `CpuStreams`: work runs when it is issued, so every marker is complete at once and the times are
  the host's clock around the handler. Same calls, same order: the CPU tests run this code path.

Times come back on one clock (seconds of `time.perf_counter`), whichever the device.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator

import torch

from .interpreter import Done


class CpuStreams:
    """Synchronous streams: an action's work is done when its handler returns."""

    def __init__(self, device: torch.device, memory: Callable[[], int]) -> None:
        self.device = device
        self._memory = memory
        self._t0: dict[int, float] = {}
        self._t1: dict[int, float] = {}

    @contextlib.contextmanager
    def issuing(self, resource: str, action_id: int, deps: Iterable[int]) -> Iterator[None]:
        """Run the body as action `action_id` on `resource`, after `deps` (already complete here)."""
        self._t0[action_id] = time.perf_counter()
        yield

    def mark_end(self, action_id: int) -> None:
        """The action's work is finished (CPU: now)."""
        self._t1[action_id] = time.perf_counter()

    def settle(self, started: Done) -> Done:
        """A transfer the handler started: returned for the host to poll (gloo completes it on a thread)."""
        return started

    def done(self, action_id: int) -> bool:
        return True

    def host_wait(self, action_ids: Iterable[int]) -> None:
        """Block the calling thread until the device work of these actions has finished."""

    def use(self, t: torch.Tensor) -> None:
        """`t` is used by the work being issued now (CUDA: keeps the allocator from reusing it early)."""

    def memory_allocated(self) -> int:
        return self._memory()

    def take_peak(self) -> tuple[int, int] | None:
        """The allocator's peak allocated and reserved bytes since the last call (CUDA; a CPU has none: None)."""
        return None

    def times(self, action_id: int) -> tuple[float, float] | None:
        """(start, end) of an issued action on the host clock, once `synchronize` has run."""
        if action_id not in self._t1:
            return None
        return self._t0[action_id], self._t1[action_id]

    def synchronize(self) -> None:
        """Wait for all issued work."""

    def forget(self) -> None:
        """Drop the markers of a finished window."""
        self._t0.clear()
        self._t1.clear()


class CudaStreams:
    """One CUDA stream per resource; start / end events per action; dependencies as event waits."""

    def __init__(self, device: torch.device, streams: dict[str, torch.cuda.Stream]) -> None:
        self.device = device
        self._streams = streams  # kept by the caller across windows
        self._start: dict[int, torch.cuda.Event] = {}
        self._end: dict[int, torch.cuda.Event] = {}
        torch.cuda.synchronize(device)
        self._base = torch.cuda.Event(enable_timing=True)
        self._base.record(torch.cuda.current_stream(device))
        torch.cuda.synchronize(device)
        self._base_s = time.perf_counter()

    def _stream(self, resource: str) -> torch.cuda.Stream:
        s = self._streams.get(resource)
        if s is None:
            s = self._streams[resource] = torch.cuda.Stream(self.device)
        return s

    @contextlib.contextmanager
    def issuing(self, resource: str, action_id: int, deps: Iterable[int]) -> Iterator[None]:
        s = self._stream(resource)
        for d in deps:
            ev = self._end.get(d)
            if ev is not None:
                s.wait_event(ev)
        start = torch.cuda.Event(enable_timing=True)
        start.record(s)
        self._start[action_id] = start
        with torch.cuda.stream(s):
            yield

    def mark_end(self, action_id: int) -> None:
        """Record the end marker on the stream current inside `issuing` (call it there)."""
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        self._end[action_id] = ev

    def settle(self, started: Done) -> Done:
        """A transfer the handler started (NCCL): the current stream waits for it, the host does not;
        its completion callback runs now (the buffer it fills is the stream's to order). None."""
        if started is not None:
            handle, on_done = started
            handle.wait()
            on_done()
        return None

    def done(self, action_id: int) -> bool:
        ev = self._end.get(action_id)
        return ev is None or ev.query()

    def host_wait(self, action_ids: Iterable[int]) -> None:
        for a in action_ids:
            ev = self._end.get(a)
            if ev is not None:
                ev.synchronize()

    def use(self, t: torch.Tensor) -> None:
        t.record_stream(torch.cuda.current_stream(self.device))

    def memory_allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def take_peak(self) -> tuple[int, int]:
        """The allocator's peak allocated and reserved bytes since the last call (or the run's start); resets them."""
        stats = torch.cuda.memory_stats(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return int(stats.get("allocated_bytes.all.peak", 0)), int(stats.get("reserved_bytes.all.peak", 0))

    def times(self, action_id: int) -> tuple[float, float] | None:
        start, end = self._start.get(action_id), self._end.get(action_id)
        if start is None or end is None:
            return None
        return (self._base_s + self._base.elapsed_time(start) / 1e3,
                self._base_s + self._base.elapsed_time(end) / 1e3)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def forget(self) -> None:
        self._start.clear()
        self._end.clear()


Streams = CpuStreams | CudaStreams


def make_streams(device: torch.device, *, kept: dict[str, torch.cuda.Stream], memory: Callable[[], int]) -> Streams:
    """The streams of one rank for one window: CUDA ones on a GPU, the synchronous stand-in on the CPU."""
    if device.type == "cuda":
        return CudaStreams(device, kept)
    return CpuStreams(device, memory)
